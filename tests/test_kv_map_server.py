"""`/kv`, `/kv/state`, `/kv/stream` and `kvforge top` against a running server.

The browser test loads the page in headless Chromium (Debian's `chromium`, which `.ci/run`
installs when absent) while streaming requests share a prefix, with generation paused
(`AsyncEngine.pause_generation`) so the page and `/kv/state` see the same step.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_fixtures import on_engine, start_server, tiny_model_dir, wait_idle_and_check_blocks

KEY = "kv-map-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tiny_model_dir(tmp_path_factory), api_key=KEY, block_size=4, num_kv_blocks=128)
    yield srv
    srv.stop()


def _state(srv, **params) -> dict:
    r = httpx.get(srv.url + "/kv/state", headers=AUTH, params=params, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(srv, predicate, what: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = _state(srv)
        if predicate(snap):
            return snap
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last state: {snap['requests']}"
        time.sleep(0.01)


def _stream_completion(srv, prompt: list[int], max_tokens: int, done: list) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        done.append((r.status_code, sum(1 for line in r.iter_lines() if line.startswith("data: "))))


def _sharing(snap: dict) -> bool:
    return sum(r["status"] == "running" for r in snap["requests"]) >= 2 and bool(snap["groups"][0]["refs"])


@pytest.fixture
def paused_with_shared_prefix(server):
    """Two streaming requests sharing a 32-token prompt, generation paused while both hold the shared blocks."""
    done: list = []
    prompt = list(range(40, 72))
    threads = [threading.Thread(target=_stream_completion, args=(server, prompt, 200, done)) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    _wait_for(server, _sharing, "two running requests sharing blocks")
    server.async_engine.pause_generation()
    try:
        on_engine(server, lambda e: None)  # served after the step in flight: from here on nothing moves
        yield _state(server)
    finally:
        server.async_engine.resume_generation()
        for t in threads:
            t.join(120)
        assert [code for code, _ in done] == [200, 200]
        wait_idle_and_check_blocks(server)


@pytest.mark.parametrize("path", ["/kv", "/kv/state", "/kv/stream"])
def test_every_kv_map_route_needs_the_key(server, path):
    assert httpx.get(server.url + path, timeout=10).status_code == 401
    assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert httpx.get(server.url + path, cookies={"kvforge_api_key": "wrong"}, timeout=10).status_code == 401
    if path != "/kv/stream":
        assert httpx.get(server.url + path, headers=AUTH, timeout=10).status_code == 200


def test_the_page_login_sets_a_cookie_and_drops_the_key_from_the_url(server):
    assert httpx.get(server.url + "/kv", params={"key": "wrong"}, timeout=10).status_code == 401
    r = httpx.get(server.url + "/kv", params={"key": KEY}, timeout=10)
    assert r.status_code == 303 and r.headers["location"] == "kv"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/kv" in cookie
    page = httpx.get(server.url + "/kv", cookies={"kvforge_api_key": KEY}, timeout=10)
    assert page.status_code == 200 and "KV block map" in page.text
    assert KEY not in page.text
    state = httpx.get(server.url + "/kv/state", cookies={"kvforge_api_key": KEY}, timeout=10)
    assert state.status_code == 200


def test_bad_parameters_get_400_naming_them(server):
    r = httpx.get(server.url + "/kv/state", headers=AUTH, params={"since": -1}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"
    r = httpx.get(server.url + "/kv/stream", headers=AUTH, params={"interval": -5}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "interval"


def test_state_equals_the_engines_snapshot_while_paused(server, paused_with_shared_prefix):
    snap = _state(server)
    direct = on_engine(server, lambda e: e.kv_map.snapshot(e))
    for key in ("step", "groups", "requests", "gauges"):
        assert snap[key] == json.loads(json.dumps(direct[key])), key
    assert max(snap["groups"][0]["refs"].values()) >= 2


def test_stream_sends_snapshots_as_the_engine_moves(server):
    done: list = []
    # long enough that the engine is still moving for several of the hub's paced snapshots on a fast machine
    worker = threading.Thread(target=_stream_completion, args=(server, list(range(10, 30)), 230, done))
    steps = []
    deadline = time.monotonic() + 60  # keep-alive comments arrive while idle: the read timeout alone never fires
    with httpx.stream("GET", server.url + "/kv/stream", headers=AUTH, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        worker.start()
        event = None
        for line in r.iter_lines():
            assert time.monotonic() < deadline, f"only {len(steps)} snapshot events in 60 s; completion: {done}"
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "snapshot":
                snap = json.loads(line[6:])
                steps.append(snap["step"])
                assert len(snap["groups"][0]["states"]) == on_engine(server, lambda e: e.kv.pools[0].num_blocks)
                if len(steps) >= 3:
                    break
    worker.join(60)
    assert [code for code, _ in done] == [200]
    assert steps == sorted(set(steps)), "each snapshot event is a newer step"
    wait_idle_and_check_blocks(server)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_headless_chromium_draws_the_pool(server, paused_with_shared_prefix, tmp_path):
    url = f"{server.url}/kv?key={KEY}"
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}", "--timeout=8000", "--window-size=1400,1000"]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    match = re.search(r'<pre id="kv-summary"[^>]*>(.*?)</pre>', dom.stdout, re.S)
    assert match and match.group(1).strip(), "the page drew nothing: " + dom.stdout[-1500:]
    summary = json.loads(match.group(1).replace("&quot;", '"'))
    state = _state(server)
    assert summary["step"] == state["step"]
    for drawn, group in zip(summary["groups"], state["groups"]):
        assert drawn["cells"] == drawn["blocks_drawn"] == group["num_blocks"]  # one cell per physical block
        assert drawn["counts"] == group["counts"]
        assert drawn["max_ref"] == max(group["refs"].values()) >= 2  # the shared prefix's ref count is drawn
    assert len(re.findall(r'class="cell s-', dom.stdout)) == state["groups"][0]["num_blocks"] + 1  # + the null block
    shot = tmp_path / "kv_map.png"
    pic = subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert pic.returncode == 0 and shot.stat().st_size > 10_000, pic.stderr[-2000:]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_kvforge_top_in_tmux_shows_the_pool_line(server, tmp_path):
    session = f"kvtop{int(time.time() * 1000) % 100000}"
    cmd = (f"{sys.executable} -m kvforge.cli top --base-url {server.url} --api-key {KEY} --interval 0.2")
    env_path = ":".join(p for p in sys.path if p)
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "140", "-y", "40",
                    f"PYTHONPATH={env_path} {cmd}"], check=True)
    try:
        deadline, screen = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
            if "pool g0 [" in screen:
                break
            time.sleep(0.2)
        blocks = on_engine(server, lambda e: e.kv.pools[0].num_blocks)
        assert re.search(rf"pool g0 \[[w*=rc.]+\] \d+/{blocks} held", screen), screen
        assert "REQUEST" in screen and "EVENTS" in screen
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_kvforge_top_once_and_a_wrong_url(server):
    env = {"PYTHONPATH": ":".join(p for p in sys.path if p)}
    ok = subprocess.run([sys.executable, "-m", "kvforge.cli", "top", "--base-url", server.url, "--api-key", KEY,
                         "--once"], capture_output=True, text=True, timeout=60, env={**env, "PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0, ok.stderr
    assert re.search(r"pool g0 \[", ok.stdout)
    bad = subprocess.run([sys.executable, "-m", "kvforge.cli", "top", "--base-url", server.url, "--once"],
                         capture_output=True, text=True, timeout=60, env={**env, "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and "HTTP 401" in bad.stderr


def test_the_embedded_state_cannot_close_its_script_element():
    from kvforge.server.kv_map import page_html

    page = page_html({"requests": [{"id": "</script><script>alert(1)</script>"}]})
    embedded = page.split('<script id="kv-initial" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert json.loads(embedded)["requests"][0]["id"] == "</script><script>alert(1)</script>"


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_a_pool_of_100k_blocks_renders_as_ranges(tmp_path_factory, tmp_path):
    srv = start_server(tiny_model_dir(tmp_path_factory), block_size=4, num_kv_blocks=100_001)
    try:
        dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                              f"--user-data-dir={tmp_path / 'profile'}", "--timeout=8000", "--dump-dom",
                              srv.url + "/kv"], capture_output=True, text=True, timeout=120)
        match = re.search(r'<pre id="kv-summary"[^>]*>(.*?)</pre>', dom.stdout, re.S)
        assert match and match.group(1).strip(), dom.stderr[-2000:]
        (group,) = json.loads(match.group(1).replace("&quot;", '"'))["groups"]
        assert group["blocks_drawn"] == group["num_blocks"] == 100_000
        assert group["cells"] <= 4096  # one cell per range of blocks
        assert srv.app.state.kv_map_hub.build_seconds < 5  # sanity only: the pace adapts to it
    finally:
        srv.stop()


class _FakeClock:
    """The hub's time, advanced only by its own sleeps and by the snapshot builds: no wall clock involved."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


class _MovingEngine:
    """What the hub reads of an `AsyncEngine`: an observer that moves `steps_per_s` steps a fake second,
    and whose snapshot costs `build_s` fake seconds on the engine thread."""

    def __init__(self, clock: _FakeClock, steps_per_s: float, build_s: float = 0.0) -> None:
        from types import SimpleNamespace

        self.clock, self.steps_per_s, self.build_s = clock, steps_per_s, build_s
        self.engine = SimpleNamespace(kv_map=self)
        self.events = SimpleNamespace(next_seq=0)

    @property
    def step(self) -> int:
        return int(self.clock.t * self.steps_per_s)

    def snapshot(self, engine, since=None) -> dict:
        self.clock.t += self.build_s
        return {"step": self.step, "next_event": 0}

    async def call(self, fn):
        return fn(self.engine)


def _stream_for(hub, seconds: float, interval: float | None = None) -> tuple[list[float], list[int], list[float]]:
    """(fake times of the snapshot events, their steps, fake times of the keep-alives) of one viewer, up to
    the first message at or after `seconds` fake seconds."""
    import asyncio

    async def run():
        times, steps, keepalives = [], [], []
        gen = hub.stream(interval)
        async for chunk in gen:
            if chunk.startswith(b"event: snapshot"):
                times.append(hub.clock())
                steps.append(json.loads(chunk.split(b"data: ", 1)[1])["step"])
            else:
                keepalives.append(hub.clock())
            if hub.clock() >= seconds:
                break
        await gen.aclose()
        return times, steps, keepalives

    return asyncio.run(run())


@pytest.mark.parametrize("build_s,interval,gap", [
    (0.0, None, 0.1),  # the engine moves 1000 steps a second: the stream sends 10 a second (DEFAULT_MAX_RATE)
    (0.0, 0.5, 0.5),  # a viewer asking for one every 0.5 s gets that
    (0.01, None, 0.5),  # a 10 ms snapshot: at most 2% of the engine thread (DEFAULT_MAX_DUTY), so 2 a second
], ids=["max-rate", "viewer-interval", "max-duty"])
def test_the_stream_is_rate_limited_on_an_injected_clock(build_s, interval, gap):
    from kvforge.server.kv_map import DEFAULT_MAX_DUTY, DEFAULT_MAX_RATE, KVMapHub

    assert DEFAULT_MAX_RATE == 10 and DEFAULT_MAX_DUTY == 0.02  # the gaps above are priced on these
    clock = _FakeClock()
    engine = _MovingEngine(clock, steps_per_s=1000, build_s=build_s)
    hub = KVMapHub(engine, clock=clock, sleep=clock.sleep)
    times, steps, _ = _stream_for(hub, seconds=10.0, interval=interval)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= gap - 1e-9, gaps
    assert 10.0 / gap - 1 <= len(times) <= 10.0 / gap + 2  # paced, not starved
    assert steps == sorted(set(steps)) and steps[-1] - steps[0] >= 1000 * 9  # each a newer step of a moving engine
    assert hub.num_built == len(times)


def test_an_idle_engine_gets_one_snapshot_then_keepalives():
    from kvforge.server.kv_map import KEEPALIVE_S, KVMapHub

    clock = _FakeClock()
    hub = KVMapHub(_MovingEngine(clock, steps_per_s=0), clock=clock, sleep=clock.sleep)
    times, _, keepalives = _stream_for(hub, seconds=3 * KEEPALIVE_S)
    assert times == [0.0] and hub.num_built == 1  # nothing moved: nothing rebuilt
    gaps = [b - a for a, b in zip(times + keepalives, keepalives)]
    assert len(keepalives) >= 3 and all(KEEPALIVE_S < g <= KEEPALIVE_S + 0.1 + 1e-9 for g in gaps), gaps
