"""Prompt sets for `kvforge bench serve`: random lengths, or many requests sharing a few prefixes.

Prompts are built from common English words, which most BPE vocabularies hold
as one token each (with the leading space), so `--input-len` is close to the
real token count; the exact counts come back in each response's `usage`.
Seeded, so two runs (or two servers) see the same workload.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part "
    "over new sound take only little work know place year live me back give most very after thing our just name "
    "good sentence man think say great where help through much before line right too mean old any same tell boy "
    "follow came want show also around form three small set put end does another well large must big even such "
    "because turn here why ask went men read need land different home us move try kind hand picture again change "
    "off play spell air away animal house point page letter mother answer found study still learn should world"
).split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_dataset(num: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """Independent prompts; lengths uniform in [len * (1 - ratio), len * (1 + ratio)]."""
    rng = random.Random(seed)
    return [BenchRequest(_words(rng, _length(rng, input_len, range_ratio)), _length(rng, output_len, range_ratio))
            for _ in range(num)]


def shared_prefix_dataset(num: int, prefix_len: int, num_prefixes: int, input_len: int, output_len: int,
                          range_ratio: float, seed: int) -> list[BenchRequest]:
    """Request i = prefix[i % num_prefixes] + its own suffix: what a prefix cache is for (system prompts)."""
    rng = random.Random(seed)
    prefixes = [f"System prompt {k}: " + _words(rng, prefix_len) for k in range(num_prefixes)]
    return [BenchRequest(prefixes[i % num_prefixes] + "\nUser: " + _words(rng, _length(rng, input_len, range_ratio)),
                         _length(rng, output_len, range_ratio)) for i in range(num)]


def check_dataset_args(args) -> None:  # type: ignore[no-untyped-def]
    """Usage errors name the flag (CLI exit 2)."""
    for flag in ("num_prompts", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.dataset == "shared-prefix" and (args.prefix_len < 1 or args.num_prefixes < 1):
        raise ValueError("--prefix-len and --num-prefixes must be >= 1 for --dataset shared-prefix")
