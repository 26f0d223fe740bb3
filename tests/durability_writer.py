"""The writer side of tests/test_disk_durability.py: processes that fill a disk tier and get killed.

A module of its own so forkserver children import it by name (pytest's test modules are not importable
that way). Each writer first serves the prompts earlier writers left on disk and reports any output that
differs from the reference: the "next process" of a kill is the next writer.
"""
from __future__ import annotations

import random
from typing import Any


def prompts(n: int = 8) -> list[list[int]]:
    shared = [(7 * i + 3) % 250 for i in range(24)]
    return [shared + [(11 * i + 5 * j + 1) % 250 for i in range(20)] for j in range(n)]


def engine_kwargs(disk: str | None) -> dict[str, Any]:
    kw: dict[str, Any] = dict(block_size=4, num_kv_blocks=40, max_model_len=64, log_ledger=False)
    if disk is not None:
        kw["kv_disk_cache"] = disk
    return kw


def write_until_killed(model: str, disk: str, reference: list[list[int]], seed: int, conn: Any) -> None:
    """Generate the prompts in a random order forever, sending 'ok' or 'WRONG i' after each one."""
    from kvforge import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(model=model, **engine_kwargs(disk))
    rng = random.Random(seed)
    ps = prompts()
    while True:
        i = rng.randrange(len(ps))
        (out,) = llm.generate(prompt_token_ids=[ps[i]], sampling_params=params)
        conn.send("ok" if list(out.outputs[0].token_ids) == reference[i] else f"WRONG {i}")
