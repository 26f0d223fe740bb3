"""End to end on Ray Serve: two kvforge replicas on a local, loopback-only Ray cluster.

Shared-prefix requests from the openai client land on the replica holding the prefix (the replica
answers in the x-kvforge-replica header), /metrics reports the routing decisions and per-replica
hit rates, and a killed replica is routed around.
"""
from __future__ import annotations

import os
import socket
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvforge.distributed.ray_serve import REPLICA_HEADER, build_app, init_local_ray  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.ray

SYSTEM = "You are a helpful assistant for the kvforge project. " * 3  # ~160 byte tokens: 10 blocks of 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ray_model"))
    build_tiny_model(path, "llama_gqa")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    init_local_ray(None, num_cpus=3)
    assert ray.util.get_node_ip_address() == "127.0.0.1"  # loopback only
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = {"model": path, "num_kv_blocks": 256, "block_size": 16, "attention_backend": "torch"}
    serve.run(build_app(engine, "tiny", num_replicas=2, stats_period_s=0.2), name="kvforge", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _wait_until(done, what: str, deadline_s: float = 60.0) -> None:
    """Poll `done()` until it holds; fail naming `what` once the deadline passes (a bound, not a timing)."""
    end = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > end:
            pytest.fail(f"after {deadline_s:.0f} s: {what}")
        time.sleep(0.05)


def _ask(client, prompt):
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    return raw.headers[REPLICA_HEADER], raw.parse()


def _wait_reported(base, blocks, timeout=20.0):
    """Until the router has seen the replicas' stored blocks (stats are polled every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics").text
        if any(line.startswith("kvforge_replica_cached_blocks") and float(line.split()[-1]) >= blocks
               for line in text.splitlines()):
            return text
        time.sleep(0.2)
    raise AssertionError(f"replicas never reported their blocks:\n{text}")


def test_shared_prefix_lands_on_holder_and_dead_replica_is_routed_around(deployment):
    client = openai.OpenAI(base_url=f"{deployment}/v1", api_key="none", max_retries=0, timeout=60)
    holder, first = _ask(client, SYSTEM + "Question 0?")
    assert first.choices[0].text is not None and first.usage.prompt_tokens > 160
    _wait_reported(deployment, 10)
    for i in range(1, 5):  # the shared system prompt is held by `holder` only
        replica, _ = _ask(client, SYSTEM + f"Question {i}?")
        assert replica == holder
    text = httpx.get(f"{deployment}/metrics").text
    assert 'kvforge_router_decisions_total{decision="affinity"} 4' in text
    assert f'kvforge_replica_prefix_cache_hit_rate{{replica="{holder}"}}' in text
    # bad input is refused at the front with the field named, and costs no replica anything
    bad = httpx.post(f"{deployment}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and "max_tokens" in bad.text

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if holder in a["name"]]
    assert len(actors) == 1
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
    _wait_until(lambda: not any(holder in a["name"] for a in ray.util.list_named_actors(all_namespaces=True)),
                f"the killed replica {holder} still listed by Ray")
    served = [_ask(client, SYSTEM + f"After the kill {i}?")[0] for i in range(3)]
    assert holder not in served


def test_bad_replica_flags_exit_2(capsys):
    from kvforge.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas" in capsys.readouterr().err
    assert main(["serve", "--ray-address", "auto"]) == 2  # joining a cluster needs a replica count
    assert "--replicas" in capsys.readouterr().err
