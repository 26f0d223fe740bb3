"""What watching the KV block map costs the server, and a screenshot of the page.

Runs the same batch (requests sharing a system prompt, streamed through /v1/completions)
against one in-process server, in interleaved rounds: none / page open / none / page open ...
("page open": headless Chromium holds `/kv` open and draws every SSE snapshot). Each pair of
neighbouring rounds gives a ratio (page-open tok/s over no-viewer tok/s); the median of those
ratios is the figure, so a machine whose speed drifts (other jobs on a shared box) moves both
halves of a pair together instead of biasing one mode. The issue's bar is >= 0.97x. With
`--screenshot PNG` it also pauses one batch midway (`AsyncEngine.pause_generation`) and saves
the page as Chromium draws it.

    python benchmarks/kv_map_overhead.py --rounds 20             # the ratio
    python benchmarks/kv_map_overhead.py --rounds 10 --control   # the harness's own spread (no page in either)
    python benchmarks/kv_map_overhead.py --rounds 0 --screenshot benchmarks/results/2026-12-05_kv_map_page.png
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvforge.engine.args import EngineArgs
from kvforge.engine.engine import LLMEngine
from kvforge.server.background import BackgroundServer

SYSTEM = ("You are a helpful assistant for a company that sells bicycles. Answer briefly and politely, "
          "and always mention the store's opening hours, 9 to 5 on weekdays. ") * 3
QUESTIONS = ["What sizes do you have?", "Do you repair tires?", "Can I rent a bike?", "Where are you?",
             "Do you sell helmets?", "Is there a warranty?", "How much is a city bike?", "Do you deliver?"]


async def _one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> int:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n += 1
    return n


async def batch(url: str, num_requests: int, max_tokens: int) -> tuple[int, float]:
    """(output tokens, seconds) of `num_requests` concurrent streamed completions."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_one(client, SYSTEM + QUESTIONS[i % len(QUESTIONS)] + f" (#{i})", max_tokens)
                                        for i in range(num_requests)))
        return sum(counts), time.perf_counter() - t0


def open_page(chromium: str, url: str, profile: str) -> subprocess.Popen:
    """Headless Chromium holding `url` open (its SSE stream live) until `close_page`; in its own session, so
    closing it can end its renderer and helper processes too."""
    return subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             f"--user-data-dir={profile}", "--remote-debugging-port=0", url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def close_page(page: subprocess.Popen, timeout: float = 30.0) -> None:
    """End the browser and every process of its group, and wait until they are gone: a renderer still
    shutting down during the next round would be charged to the no-viewer round."""
    os.killpg(page.pid, signal.SIGTERM)
    page.wait(timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(page.pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(page.pid, signal.SIGKILL)
        time.sleep(0.05)


def screenshot(chromium: str, srv: BackgroundServer, path: str, num_requests: int, max_tokens: int) -> None:
    async def run() -> None:
        task = asyncio.ensure_future(batch(srv.url, num_requests, max_tokens))
        while True:  # midway: every request admitted and decoding
            await asyncio.sleep(0.05)
            snap = (await asyncio.to_thread(httpx.get, srv.url + "/kv/state", timeout=30)).json()
            if sum(r["status"] == "running" for r in snap["requests"]) >= min(num_requests, 6) and snap["step"] > 20:
                break
        srv.async_engine.pause_generation()
        with tempfile.TemporaryDirectory() as profile:
            await asyncio.to_thread(subprocess.run, [
                chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", "--timeout=8000", "--window-size=1500,900",
                f"--screenshot={Path(path).resolve()}", srv.url + "/kv"], capture_output=True, timeout=120)
        srv.async_engine.resume_generation()
        await task

    asyncio.run(run())
    print(f"screenshot: {path}")


def wait_for_viewer(srv: BackgroundServer, built_before: int, timeout: float = 60.0) -> None:
    """Until the page has loaded and its stream sent a snapshot (two snapshots built since it opened)."""
    hub, deadline = srv.app.state.kv_map_hub, time.monotonic() + timeout
    while hub.num_built < built_before + 2:
        if time.monotonic() > deadline:
            raise RuntimeError("headless Chromium did not open /kv and its stream")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of rounds (no viewer, page open); 0: screenshot only")
    ap.add_argument("--screenshot", default=None, metavar="PNG")
    ap.add_argument("--kv-cache-memory", default="64MiB", help="a small pool, so the page shows it filling")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="idle seconds right before every round's batch (after the page is open), the same for both modes")
    ap.add_argument("--control", action="store_true",
                    help="an A/A check of the harness: the second round of each pair opens no page either")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("needs chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    engine = LLMEngine(EngineArgs(model=args.model, kv_cache_memory=args.kv_cache_memory, log_ledger=False))
    srv = BackgroundServer(engine, model_name="m").start()
    hub = srv.app.state.kv_map_hub
    try:
        asyncio.run(batch(srv.url, 4, 8))  # warm-up: kernels, caches
        if args.screenshot:
            screenshot(chromium, srv, args.screenshot, args.num_requests, args.max_tokens)
        ratios, what = [], "second/first (control: no page in either)" if args.control else "page/none"
        for r in range(args.rounds):
            pair = {}
            for mode in ("none", "page"):
                on_engine_reset(srv)
                page = None
                built = hub.num_built
                with tempfile.TemporaryDirectory() as profile:
                    if mode == "page" and not args.control:
                        page = open_page(chromium, srv.url + "/kv", profile)
                        wait_for_viewer(srv, built)
                    time.sleep(args.settle)
                    built = hub.num_built
                    tokens, seconds = asyncio.run(batch(srv.url, args.num_requests, args.max_tokens))
                    snapshots = hub.num_built - built
                    if page is not None:
                        close_page(page)
                pair[mode] = tokens / seconds
                label = "none" if page is None else "page"
                print(f"round {r + 1} {label:>4}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} out tok/s, "
                      f"{snapshots} snapshots built", flush=True)
            ratios.append(pair["page"] / pair["none"])
            print(f"pair {r + 1}: {what} = {ratios[-1]:.3f}", flush=True)
        if ratios:
            print("per-pair ratios: " + " ".join(f"{x:.3f}" for x in ratios))
            print(f"median ratio {what} over {len(ratios)} pairs: {statistics.median(ratios):.3f}x (target >= 0.97x); "
                  f"range {min(ratios):.3f}-{max(ratios):.3f}; last snapshot took {hub.build_seconds * 1000:.2f} ms")
    finally:
        srv.stop()
    return 0


def on_engine_reset(srv: BackgroundServer) -> None:
    """Each round starts from an empty prefix cache, so rounds do the same work."""
    asyncio.run(srv.async_engine.call(lambda e: e.reset_prefix_cache()))


if __name__ == "__main__":
    sys.exit(main())
