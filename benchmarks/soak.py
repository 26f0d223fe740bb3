"""Soak: `kvforge serve` under mixed traffic with aborts for a long time; does anything drift?

Starts the server as its own process (so RSS is the server's alone), then runs `--clients`
threads that loop over a mix of requests: streamed and plain completions, chat, n=2
samples, shared-prefix prompts, and streams the client abandons after a few events
(aborts). Every `--interval` seconds it samples the server's RSS, the KV cache usage and
free blocks from /metrics, and the request counts. At the end it waits for the engine to go
idle and checks that every KV block is back in the pool.

Drift verdict (issue 38's target): RSS plateaus when its growth over the last 20 minutes
(`--plateau-window`; the second half of a run shorter than 40 minutes) is under 5% of the
RSS at the window's start; the earlier part absorbs allocator warm-up.

    python benchmarks/soak.py [--duration 1800] [--model PATH] [--clients 6] [--save benchmarks/results/YYYY-MM-DD_soak.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "You are a meticulous assistant for a logistics company; cite the policy section you rely on. " * 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if not s.name.startswith("vllm:") and set(s.labels) <= {"model_name"}:
                out[s.name] = s.value
    return out


def _is_error_event(line: str) -> bool:
    """An SSE event that carries an error object (not a completion whose text happens to be "error")."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    try:
        event = json.loads(line[len("data: "):])
    except ValueError:
        return True  # a malformed event is an error too
    return isinstance(event, dict) and "error" in event


class Traffic:
    """Client threads looping over the request mix; counts outcomes (anything but 200 is an error)."""

    def __init__(self, url: str, model: str, clients: int, seed: int) -> None:
        self.url, self.model, self.clients = url, model, clients
        self.counts = {"ok": 0, "aborted": 0, "errors": 0}
        self.error_samples: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(seed + i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _count(self, key: str, detail: str = "") -> None:
        with self._lock:
            self.counts[key] += 1
            if detail and len(self.error_samples) < 5:
                self.error_samples.append(detail[:300])

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=300) as http:
            while not self._stop.is_set():
                try:
                    self._one(http, rng)
                except httpx.HTTPError as exc:
                    self._count("errors", repr(exc))

    def _one(self, http: httpx.Client, rng: random.Random) -> None:
        kind = rng.choice(["stream", "plain", "chat", "n2", "prefix", "abort", "abort"])
        words = " ".join(rng.choice(["cargo", "route", "invoice", "delay", "port", "truck"]) for _ in range(rng.randint(3, 60)))
        body: dict = {"model": self.model, "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.7]),
                      "prompt": (PREFIX if kind == "prefix" else "") + words}
        path = "/v1/completions"
        if kind == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": body.pop("prompt")}]
        if kind == "n2":
            body.update(n=2, seed=rng.randint(0, 2**63 - 1), temperature=0.8)
        if kind in ("stream", "abort"):
            stop_after = rng.randint(1, 5) if kind == "abort" else None
            with http.stream("POST", path, json={**body, "stream": True, "max_tokens": 64 if stop_after else body["max_tokens"]}) as r:
                if r.status_code != 200:
                    r.read()
                    return self._count("errors", f"{r.status_code} {r.text}")
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: ")
                    if stop_after is not None and n >= stop_after:
                        return self._count("aborted")
                    if _is_error_event(line):
                        return self._count("errors", line)
            return self._count("ok")
        r = http.post(path, json=body)
        self._count("ok" if r.status_code == 200 else "errors", "" if r.status_code == 200 else f"{r.status_code} {r.text}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800 = 30 min)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between samples (default 30)")
    p.add_argument("--plateau-window", type=float, default=1200.0,
                   help="seconds at the end of the run whose RSS growth decides the verdict (default 1200 = 20 min)")
    p.add_argument("--plateau-limit", type=float, default=0.05, help="growth allowed over the window (default 5%%)")
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="write the samples and verdict as JSON here")
    args = p.parse_args()

    port = _free_port()
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", "--port", str(port), "--served-model-name", "soak",
           "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", str(args.max_model_len),
           "--log-level", "warning", "--max-num-seqs", "16"]
    if args.model:
        cmd += ["--model", args.model]
    log = tempfile.TemporaryFile("w+")  # the server's stderr (ledger, warnings): a file, so it can never block
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                log.seek(0)
                raise SystemExit(f"the server exited: {log.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up in 300 s")
            time.sleep(0.5)
        proc = psutil.Process(server.pid)
        traffic = Traffic(url, "soak", args.clients, args.seed)
        samples = []
        start = time.monotonic()
        traffic.start()
        print(f"{'t (s)':>7} {'RSS (MB)':>9} {'KV usage':>9} {'free/total':>11} {'ok':>6} {'aborted':>8} {'errors':>7}")
        while True:
            elapsed = time.monotonic() - start
            m = _metrics(url)
            row = {"t": round(elapsed, 1), "rss_mb": proc.memory_info().rss / 2**20,
                   "kv_usage": m.get("kvforge_kv_cache_usage_ratio", 0.0),
                   "blocks_free": m.get("kvforge_kv_blocks_free", 0), "blocks_total": m.get("kvforge_kv_blocks_total", 0),
                   **traffic.counts}
            samples.append(row)
            print(f"{row['t']:>7.0f} {row['rss_mb']:>9.1f} {row['kv_usage']:>9.3f} "
                  f"{int(row['blocks_free']):>5}/{int(row['blocks_total']):<5} {row['ok']:>6} {row['aborted']:>8} "
                  f"{row['errors']:>7}", flush=True)
            if elapsed >= args.duration:
                break
            time.sleep(min(args.interval, max(0.0, args.duration - elapsed)))
        traffic.stop()
        deadline = time.monotonic() + 120
        while True:  # aborted streams are freed at the engine's next step
            m = _metrics(url)
            if m["kvforge_kv_blocks_free"] == m["kvforge_kv_blocks_total"] and not m["kvforge_requests_running"]:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        idle_rss = proc.memory_info().rss / 2**20
        end_t = samples[-1]["t"]
        window = args.plateau_window if end_t >= 2 * args.plateau_window else end_t / 2
        half = next(s for s in samples if s["t"] >= end_t - window)
        growth = (samples[-1]["rss_mb"] - half["rss_mb"]) / half["rss_mb"]
        verdict = {
            "duration_s": end_t, "rss_start_mb": samples[0]["rss_mb"], "rss_window_start_mb": half["rss_mb"],
            "plateau_window_s": window, "rss_end_mb": samples[-1]["rss_mb"], "rss_idle_after_mb": idle_rss,
            "window_growth": growth, "rss_plateaus": growth < args.plateau_limit,
            "blocks_all_free_after": m["kvforge_kv_blocks_free"] == m["kvforge_kv_blocks_total"],
            "counts": traffic.counts, "error_samples": traffic.error_samples,
        }
        print(f"\nRSS {verdict['rss_start_mb']:.0f} -> {verdict['rss_window_start_mb']:.0f} (at t={half['t']:.0f} s) -> "
              f"{verdict['rss_end_mb']:.0f} MB; growth over the last {window:.0f} s {growth:+.1%} "
              f"(limit {args.plateau_limit:.0%}): "
              f"{'plateaus' if verdict['rss_plateaus'] else 'STILL GROWING'}")
        print(f"KV blocks all free after the run: {verdict['blocks_all_free_after']}; "
              f"requests ok={traffic.counts['ok']} aborted={traffic.counts['aborted']} errors={traffic.counts['errors']}")
        for e in traffic.error_samples:
            print("  error:", e)
        if args.save:
            os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
            with open(args.save, "w") as f:
                json.dump({"args": vars(args), "samples": samples, "verdict": verdict}, f, indent=1)
        return 0 if verdict["blocks_all_free_after"] and not traffic.counts["errors"] else 1
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
