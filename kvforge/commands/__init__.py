"""Every `kvforge` command, one line each: the words typed after `kvforge` -> the module that implements it.

A command module defines, at module level, only what building the parser needs
(standard library and torch-free kvforge modules; a test holds every module here
to core dependencies):

    HELP = "one line for `kvforge --help`"            # the module docstring is the description
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...      # heavy imports (torch, the engine) go inside

Two words (`"bench serve"`) put the command under a group; the group's one-line
help is in GROUPS. `kvforge.cli` builds the parser from this table.
"""
from __future__ import annotations

COMMANDS: dict[str, str] = {
    "generate": "kvforge.commands.generate",
    "chat": "kvforge.commands.chat",
    "plan": "kvforge.commands.plan",
    "serve": "kvforge.commands.serve",
    "bench serve": "kvforge.commands.bench_serve",
    "cache explain": "kvforge.commands.cache",
    "eval kv-quant": "kvforge.commands.eval",
    "learn why-cache": "kvforge.commands.learn_why_cache",
    "learn prefill-vs-decode": "kvforge.commands.learn_prefill_vs_decode",
    "learn paging": "kvforge.commands.learn_paging",
    "learn quant-at-length": "kvforge.commands.learn_quant_at_length",
    "eval kv-evict": "kvforge.commands.eval_evict",
    "eval weights": "kvforge.commands.eval_weights",
    "top": "kvforge.commands.top",
}

GROUPS: dict[str, str] = {
    "bench": "benchmarks (serve: load-test an OpenAI-compatible server)",
    "cache": "prefix-cache tools (explain a miss)",
    "eval": "quality evaluations (kv-quant: KV-cache quantization; kv-evict: KV eviction; weights: int8/int4 weights)",
    "learn": "runnable, measured lessons: why-cache, prefill-vs-decode, paging, quant-at-length (kvforge/learn/)",
}
