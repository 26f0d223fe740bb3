"""`kvforge learn paging`: paged blocks vs contiguous reservation: utilization, concurrency, tok/s (kvforge/learn/paging.py).

With `--serve`, the same workload runs through `kvforge serve`'s engine, contiguous then paged,
and the learner watches the KV block map at `/kv` (or `kvforge top`): in contiguous mode each
sequence holds a region of max_model_len slots that stays mostly reserved and empty, and
requests wait; in paged mode the blocks fill as tokens arrive and more sequences run at once.
"""
from __future__ import annotations

import argparse
import sys

from kvforge.commands.learn import add_demo_arguments, run_demo

HELP = "paged blocks vs contiguous reservation: utilization, concurrency, tok/s (--serve: watch it at /kv)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_demo_arguments(parser, "paging")


def run(args: argparse.Namespace) -> int:
    if not args.serve:
        return run_demo("kvforge.learn.paging", args)
    for name in ("rounds", "pause", "port"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "rounds" else 0):
            print(f"kvforge learn paging: --{name} must be >= {1 if name == 'rounds' else 0}, got {value}",
                  file=sys.stderr)
            return 2
    return serve_lesson(args)


def serve_lesson(args: argparse.Namespace) -> int:
    """Both modes in rounds through an HTTP server, printing each mode's utilization and concurrency."""
    import asyncio
    import itertools
    import time

    import httpx

    from kvforge.learn.common import make_engine
    from kvforge.learn.paging import lesson_config, workload
    from kvforge.server.background import BackgroundServer

    cfg, engine_kwargs = lesson_config(args)
    engine = make_engine(args.model, args.dtype, args.threads, **engine_kwargs)
    prompts, out_lens = workload(cfg, engine.model_config.vocab_size)
    srv = BackgroundServer(engine, model_name="lesson", port=args.port).start()
    rounds = args.rounds or (1 if args.quick else None)
    print(f"open {srv.url}/kv in a browser (or run: kvforge top --base-url {srv.url}); Ctrl-C ends the lesson",
          flush=True)

    async def send_all() -> int:
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
            async def one(prompt: list[int], n: int) -> int:
                r = await client.post("/v1/completions", json={"model": "lesson", "prompt": prompt, "max_tokens": n,
                                                                "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                return int(r.json()["usage"]["completion_tokens"])
            return sum(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, out_lens))))

    try:
        for r in itertools.count(1):
            for mode in ("contiguous", "paged"):
                asyncio.run(srv.async_engine.call(lambda e, m=mode: e.reconfigure_kv_cache(kv_allocation=m)))
                print(f"round {r}, {mode}: {len(prompts)} requests of mixed lengths ...", flush=True)
                t0 = time.perf_counter()
                tokens = asyncio.run(send_all())
                wall = time.perf_counter() - t0
                s = asyncio.run(srv.async_engine.call(lambda e: e.kv_usage.as_dict()))
                print(f"  {mode}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s), KV utilization "
                      f"{100 * s['kv_mean_utilization']:.1f}%, peak {int(s['peak_running_seqs'])} sequences at once",
                      flush=True)
                time.sleep(args.pause)
            if rounds is not None and r >= rounds:
                break
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0
