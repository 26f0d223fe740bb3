"""What watching the KV block map costs the server, and a screenshot of the page.

Runs the same batch (requests sharing a system prompt, streamed through /v1/completions)
against one in-process server, in alternating rounds: with no viewer, then with headless
Chromium holding `/kv` open (the page draws every SSE snapshot). Prints output tokens/s per
round and the ratio of medians; the issue's bar is >= 0.97x. With `--screenshot PNG` it also
pauses one batch midway (`AsyncEngine.pause_generation`) and saves the page as Chromium draws it.

    python benchmarks/kv_map_overhead.py --rounds 3 --screenshot benchmarks/results/2026-12-04_kv_map_page.png

Quote the ratio from one run on a quiet machine: on two cores the browser competes with the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
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
    """Headless Chromium holding `url` open (its SSE stream live) until terminated."""
    return subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             f"--user-data-dir={profile}", "--remote-debugging-port=0", url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
                f"--user-data-dir={profile}", "--timeout=8000", "--window-size=1500,1100",
                f"--screenshot={Path(path).resolve()}", srv.url + "/kv"], capture_output=True, timeout=120)
        srv.async_engine.resume_generation()
        await task

    asyncio.run(run())
    print(f"screenshot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (no viewer, page open)")
    ap.add_argument("--screenshot", default=None, metavar="PNG")
    ap.add_argument("--kv-cache-memory", default="64MiB", help="a small pool, so the page shows it filling")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("needs chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    engine = LLMEngine(EngineArgs(model=args.model, kv_cache_memory=args.kv_cache_memory, log_ledger=False))
    srv = BackgroundServer(engine, model_name="m").start()
    try:
        asyncio.run(batch(srv.url, 4, 8))  # warm-up: kernels, caches
        if args.screenshot:
            screenshot(chromium, srv, args.screenshot, args.num_requests, args.max_tokens)
        rates: dict[str, list[float]] = {"none": [], "page": []}
        for r in range(args.rounds):
            for mode in ("none", "page"):
                on_engine_reset(srv)
                page = None
                with tempfile.TemporaryDirectory() as profile:
                    if mode == "page":
                        page = open_page(chromium, srv.url + "/kv", profile)
                        time.sleep(3)  # the page loaded and its stream is open
                    tokens, seconds = asyncio.run(batch(srv.url, args.num_requests, args.max_tokens))
                    if page is not None:
                        page.terminate()
                        page.wait(30)
                rates[mode].append(tokens / seconds)
                print(f"round {r + 1} {mode:>4}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} out tok/s",
                      flush=True)
        none, page_ = statistics.median(rates["none"]), statistics.median(rates["page"])
        print(f"median out tok/s: no viewer {none:.1f}, page open {page_:.1f}; ratio {page_ / none:.3f}x "
              f"(target >= 0.97x); snapshots built {srv.app.state.kv_map_hub.num_built}, "
              f"last took {srv.app.state.kv_map_hub.build_seconds * 1000:.2f} ms")
    finally:
        srv.stop()
    return 0


def on_engine_reset(srv: BackgroundServer) -> None:
    """Each round starts from an empty prefix cache, so rounds do the same work."""
    asyncio.run(srv.async_engine.call(lambda e: e.reset_prefix_cache()))


if __name__ == "__main__":
    sys.exit(main())
