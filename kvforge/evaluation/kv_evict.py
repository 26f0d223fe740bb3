"""`kvforge eval kv-evict`: what each KV eviction policy and budget costs in quality.

Measured on CPython's documentation (`pydoc_data.topics`, offline and reproducible), for each policy
(streaming, h2o, snapkv) and budget (fractions of the prompt and fixed token counts), against the
full cache of the same engine:

- perplexity as the text streams in (the StreamingLLM protocol): the text is fed in chunks of
  `stream_chunk` tokens and the sequence is cut to its budget after every chunk, so later chunks see
  only what the policy kept;
- teacher-forced step agreement: along the full cache's greedy path after a long prompt, the share of
  steps where the evicting cache ranks the same token first (the prompt is prefilled whole, cut, then
  the path is fed one token at a time, cutting as decode does);
- free-running same-prefix: the engine's own greedy output with the per-request budget
  (`SamplingParams.kv_budget`), the fraction of tokens before the first difference;
- passkey retrieval: a 5-digit key hidden early in ~1.1K tokens of documentation, asked for at the
  end; correct when the exact key (not a longer digit run) is among 8 greedy tokens.

In every measurement the first generated token is sampled from the full prompt cache (the engine cuts
the prompt right after its last chunk), as in OpenVINO GenAI; the perplexity protocol alone evicts
while the text is still coming in.
"""
from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvforge.engine.request import Request
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import ScheduledChunk
from kvforge.evaluation.kv_quant import bos_prefix, corpus_token_ids

POLICIES = ("streaming", "h2o", "snapkv")
DEFAULT_BUDGETS = ("10%", "20%", "40%", "60%", "128", "256")
PASSKEY_INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass
class EvictOptions:
    policies: tuple[str, ...] = POLICIES
    budgets: tuple[str, ...] = DEFAULT_BUDGETS  # "N%" of the prompt (or text), or "N" tokens
    ppl_tokens: int = 2048
    stream_chunk: int = 64
    num_prompts: int = 4
    prompt_tokens: int = 1536
    gen_tokens: int = 128
    passkey_prompts: int = 6
    passkey_tokens: int = 1100

    def __post_init__(self) -> None:
        for name in ("ppl_tokens", "stream_chunk", "num_prompts", "prompt_tokens", "gen_tokens", "passkey_prompts",
                     "passkey_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for b in self.budgets:
            if not re.fullmatch(r"\d+%?", b) or int(b.rstrip("%")) < 1:
                raise ValueError(f"--budgets item {b!r}: expected N% of the prompt or N tokens")
        for p in self.policies:
            if p not in POLICIES:
                raise ValueError(f"--policies item {p!r}: expected one of {', '.join(POLICIES)}")


def budget_tokens(label: str, length: int, block_size: int) -> int:
    """Tokens kept for a budget label: a share of `length` or a fixed count, whole blocks."""
    tokens = length * int(label[:-1]) // 100 if label.endswith("%") else int(label)
    return max(block_size, tokens // block_size * block_size)


@dataclass
class EvictRow:
    policy: str
    budget: str
    perplexity: float | None = 0.0  # None: not measured (the kvpress referee's rows)
    step_agreement: float | None = 1.0
    same_prefix: float | None = 1.0
    passkey: int = 0
    passkey_total: int = 0
    kept: float = 1.0  # mean share of the prompt's tokens kept after the cut (free-running prompts)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def passkey_parts(tokenizer, key: str) -> tuple[list[int], list[int], list[int]]:
    """The intro (after `bos_prefix`), the needle that states `key`, and the question, as token ids."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return bos_prefix(tokenizer) + enc(PASSKEY_INTRO), enc(f"The pass key is {key}. Remember it. {key} is the pass key.\n"), enc(PASSKEY_QUESTION)


def passkey_ids(parts: tuple[list[int], list[int], list[int]], doc: list[int], cut: int) -> list[int]:
    """The intro, `doc` with the needle after its first `cut` tokens, then the question."""
    head, needle, ask = parts
    return head + doc[:cut] + needle + doc[cut:] + ask


def passkey_prompts(tokenizer, count: int, tokens: int) -> list[tuple[list[int], str]]:
    """(prompt ids, key) pairs: the key sits early (10% depth) in `tokens` tokens of documentation, asked at
    the end. `evaluation/passkey_depth.py` places it at any depth in longer prompts."""
    rng = random.Random(1234)
    corpus = corpus_token_ids(tokenizer, tokens * (count + 1))
    out = []
    for i in range(count):
        key = str(rng.randint(10000, 99999))
        parts = passkey_parts(tokenizer, key)
        filler = corpus[i * tokens : (i + 1) * tokens][: max(0, tokens - sum(map(len, parts)))]
        out.append((passkey_ids(parts, filler, len(filler) // 10), key))
    return out


def found_key(text: str, key: str) -> bool:
    return re.search(rf"(?<!\d){key}(?!\d)", text) is not None


class KVEvictEval:
    """Runs every measurement on one loaded engine, rebuilding its KV pool per policy."""

    def __init__(self, engine, options: EvictOptions) -> None:
        self.engine, self.opts = engine, options
        tok = engine.tokenizer
        if tok is None:
            raise ValueError("kvforge eval kv-evict needs a model with a tokenizer")
        o = options
        bos = bos_prefix(tok)
        corpus = corpus_token_ids(tok, o.ppl_tokens + o.num_prompts * o.prompt_tokens)
        self.text = bos + corpus[: o.ppl_tokens - len(bos)]
        rest = corpus[o.ppl_tokens :]
        self.prompts = [bos + rest[i * o.prompt_tokens : (i + 1) * o.prompt_tokens - len(bos)] for i in range(o.num_prompts)]
        self.passkeys = passkey_prompts(tok, o.passkey_prompts, o.passkey_tokens)
        self.greedy = SamplingParams(temperature=0, max_tokens=o.gen_tokens, ignore_eos=True)
        self.base: list[list[int]] = []
        self._ids = 0

    # ---- engine plumbing ----------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], int]]:
        """Greedy outputs and tokens evicted, in order, through the engine's scheduler."""
        eng = self.engine
        ids = [eng.add_request(None, p, ids) for ids, p in zip(prompts, params)]
        done: dict[str, tuple[list[int], int]] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = (list(out.outputs[0].token_ids), out.num_evicted_tokens)
        return [done[i] for i in ids]

    def _feed(self, tokens: list[int], budget: int | None, first_chunk: int, chunk: int) -> torch.Tensor:
        """Logits for every token after the first, fed `first_chunk` then `chunk` tokens at a time, the
        sequence cut to `budget` after each feed (None: full cache)."""
        eng = self.engine
        self._ids += 1
        req = Request(f"eval-{self._ids}", tokens[:first_chunk], SamplingParams(), kv_budget=budget)
        logits = []
        try:
            while req.num_computed_tokens < len(tokens):
                start = req.num_computed_tokens
                n = first_chunk if start == 0 else min(chunk, len(tokens) - start)
                req.all_token_ids[:] = tokens[: start + n]
                if eng.kv.allocate_slots(req, n) is None:
                    raise ValueError("the evaluation's KV pool is too small for its texts")
                sched = ScheduledChunk(req, start, n, block_ids=eng.kv.block_ids(req.request_id))
                scored = budget is not None and eng.eviction is not None
                step_logits, mass = eng.runner.chunk_logits(sched, eng.eviction.scoring_for([sched]) if scored else None)
                if mass is not None:
                    eng.eviction.collect(mass, [sched])
                logits.append(step_logits)
                req.num_computed_tokens = start + n
                if budget is not None:
                    eng.eviction.evict(req)
        finally:
            eng.kv.free(req)
            if eng.eviction is not None:
                eng.eviction.release(req.request_id)
        return torch.cat(logits)

    # ---- measurements -------------------------------------------------------------------------
    def _perplexity(self, budget: int | None) -> float:
        logits = self._feed(self.text, budget, self.opts.stream_chunk, self.opts.stream_chunk)
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        nll = -logp.gather(1, torch.tensor(self.text[1:])[:, None]).sum()
        return math.exp(float(nll) / (len(self.text) - 1))

    def _step_agreement(self, label: str) -> float:
        agree = total = 0
        bs = self.engine.kv.block_size
        for prompt, base in zip(self.prompts, self.base):
            logits = self._feed(prompt + base[:-1], budget_tokens(label, len(prompt), bs), len(prompt), 1)
            picks = logits[len(prompt) - 1 :].argmax(dim=-1).tolist()
            agree += sum(int(a == b) for a, b in zip(picks, base))
            total += len(base)
        return agree / total

    def full_cache_row(self) -> EvictRow:
        eng = self.engine
        eng.reconfigure_kv_cache(kv_eviction="none", kv_budget=None)
        row = EvictRow("full cache", "100%")
        row.perplexity = self._perplexity(None)
        self.base = [t for t, _ in self._generate(self.prompts, [self.greedy] * len(self.prompts))]
        row.passkey, row.passkey_total = self._passkey([None] * len(self.passkeys)), len(self.passkeys)
        return row

    def _passkey(self, budgets: list[int | None]) -> int:
        params = [SamplingParams(temperature=0, max_tokens=8, kv_budget=b) for b in budgets]
        outs = self._generate([p for p, _ in self.passkeys], params)
        tok = self.engine.tokenizer
        return sum(found_key(tok.decode(ids), key) for (ids, _), (_, key) in zip(outs, self.passkeys))

    def policy_rows(self, policy: str, progress=None) -> list[EvictRow]:  # type: ignore[no-untyped-def]
        eng, o = self.engine, self.opts
        bs = eng.kv.block_size
        eng.reconfigure_kv_cache(kv_eviction=policy, kv_budget=max(budget_tokens(b, o.prompt_tokens, bs) for b in o.budgets))
        rows = []
        for label in o.budgets:
            row = EvictRow(policy, label)
            try:
                row.perplexity = self._perplexity(budget_tokens(label, len(self.text), bs))
                row.step_agreement = self._step_agreement(label)
                budgets = [budget_tokens(label, len(p), bs) for p in self.prompts]
                outs = self._generate(self.prompts, [_with_budget(self.greedy, b) for b in budgets])
                row.same_prefix = sum(_same_prefix(mine, base) for (mine, _), base in zip(outs, self.base)) / len(outs)
                row.kept = sum(min(1.0, b / len(p)) for b, p in zip(budgets, self.prompts)) / len(budgets)
                row.passkey = self._passkey([budget_tokens(label, len(p), bs) for p, _ in self.passkeys])
                row.passkey_total = len(self.passkeys)
            except ValueError as exc:  # a budget below the sinks + recent window: reported, not fatal
                row.notes.append(str(exc))
            rows.append(row)
            if progress is not None:
                progress(row)
        return rows


def _with_budget(params: SamplingParams, budget: int) -> SamplingParams:
    return SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens, ignore_eos=True, kv_budget=budget)


def _same_prefix(mine: list[int], base: list[int]) -> float:
    first = next((i for i, (a, b) in enumerate(zip(mine, base)) if a != b), len(base))
    return first / len(base)


def run_kv_evict_eval(engine, options: EvictOptions, progress=None,  # type: ignore[no-untyped-def]
                      referee: Callable[[KVEvictEval], list[EvictRow]] | None = None) -> list[EvictRow]:
    """The full cache, then each policy's rows, then `referee`'s (the kvpress rows) on the same inputs."""
    ev = KVEvictEval(engine, options)
    rows = [ev.full_cache_row()]
    if progress is not None:
        progress(rows[0])
    for policy in options.policies:
        rows += ev.policy_rows(policy, progress)
    engine.check_integrity()
    if referee is not None:
        rows += referee(ev)
    return rows


def _cell(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def render_table(rows: list[EvictRow], opts: EvictOptions, model: str) -> str:
    head = (f"kvforge eval kv-evict  {model}\n"
            f"  ppl: {opts.ppl_tokens} tokens streamed in chunks of {opts.stream_chunk}; agreement: {opts.num_prompts} "
            f"prompts x {opts.prompt_tokens} tokens, {opts.gen_tokens} generated; passkey: {opts.passkey_prompts} x "
            f"~{opts.passkey_tokens} tokens\n")
    lines = [f"| policy | budget | ppl (streamed) | step agreement | same prefix | passkey |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r.notes:
            lines.append(f"| {r.policy} | {r.budget} | – | – | – | – ({r.notes[0][:60]}) |")
            continue
        lines.append(f"| {r.policy} | {r.budget} | {_cell(r.perplexity, '{:.2f}')} | "
                     f"{_cell(None if r.step_agreement is None else 100 * r.step_agreement, '{:.1f}%')} | "
                     f"{_cell(None if r.same_prefix is None else 100 * r.same_prefix, '{:.1f}%')} | "
                     f"{r.passkey}/{r.passkey_total} |")
    return head + "\n".join(lines)


def save_plot(rows: list[EvictRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    full = rows[0]
    for policy in sorted({r.policy for r in rows[1:]}):
        mine = [r for r in rows if r.policy == policy and not r.notes]
        labels = [r.budget for r in mine]
        if all(r.perplexity is not None for r in mine):  # the kvpress referee measures no perplexity
            axes[0].plot(labels, [r.perplexity for r in mine], marker="o", label=policy)
        if all(r.step_agreement is not None for r in mine):
            axes[1].plot(labels, [100 * r.step_agreement for r in mine], marker="o", label=policy)
        axes[2].plot(labels, [r.passkey for r in mine], marker="o", label=policy)
    axes[0].axhline(full.perplexity, color="gray", ls="--", label="full cache")
    axes[2].axhline(full.passkey, color="gray", ls="--", label="full cache")
    for ax, title in zip(axes, ("perplexity, text streamed in", "teacher-forced step agreement (%)", "passkey correct")):
        ax.set_title(title)
        ax.set_xlabel("KV budget (share of prompt, or tokens)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
