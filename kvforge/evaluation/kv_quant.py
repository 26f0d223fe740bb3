"""`kvforge eval kv-quant`: what each KV-cache format costs in quality, and what it buys in capacity.

One engine is loaded once; for each cache variant (K dtype, V dtype, scale
granularity) the KV pool is rebuilt around the same weights
(`LLMEngine.reconfigure_kv_cache`) and measured on real English text: CPython's
own documentation (`pydoc_data.topics`), so the numbers are reproducible offline.

- perplexity at each context length: one or more windows of L tokens scored
  through the paged path in prefill chunks (`long_context.score_window`): each
  chunk's attention writes its K/V into the (quantized) cache and reads every
  earlier token back from it, so a 32K window needs one chunk's memory;
- the depth profile: perplexity of each quarter of the longest window, where
  accumulated error would show first;
- KL(P_unquantized || P_variant) of the next-token distribution, averaged over
  the scored positions of every window (every position up to 2048 tokens, then
  2048 evenly spaced ones per window);
- greedy agreement on `num_prompts` prompts (the head of different topics),
  `gen_tokens` tokens each: "step agreement" is the share of the unquantized
  run's greedy tokens that the variant also ranks first given the same history
  (teacher-forced, so one early flip does not void the rest), and "same prefix"
  is how far the variant's own free-running greedy output (the decode path)
  matches the unquantized output before the first difference;
- capacity from the ledger: bytes per token and the blocks and full-length
  sequences a fixed KV memory holds.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from kvforge.engine.sampling_params import SamplingParams
from kvforge.tokenizer import bos_prefix  # re-exported: the eval modules and tests take it from here
from kvforge.evaluation.long_context import DEFAULT_PREFILL_CHUNK, depth_perplexity, kl_sum, score_window
from kvforge.ledger import (
    DEFAULT_KV_ROTATION,
    NULL_BLOCKS_PER_GROUP,
    KVCacheFormat,
    default_kv_scale,
    kv_bytes_per_token,
    max_concurrency,
    num_blocks_for_memory,
    parse_kv_format,
)

DEFAULT_VARIANTS = (
    "auto", "bfloat16", "fp8_e4m3", "fp8_e4m3:none", "fp8_e5m2", "fp8_e4m3@tensor", "int8", "int8:none", "int8@head",
    "int8@channel", "int8@tensor", "int4", "int4@head", "int4@channel", "auto/fp8_e4m3", "auto/int4",
)  # ":none": stored plain, beside the default Hadamard-rotated rows


@dataclass(frozen=True)
class Variant:
    """One row: `KDTYPE[/VDTYPE][@SCALE][:ROTATION]`, e.g. `fp8_e4m3`, `int4@channel`, `auto/int4` (K auto,
    V int4), `int8:none` (int8 stored without the default Hadamard rotation)."""

    spec: str
    k_cache_dtype: str
    v_cache_dtype: str
    kv_cache_scale: str
    kv_cache_rotation: str = DEFAULT_KV_ROTATION

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        fmt = parse_kv_format(spec, "--formats item")  # the ledger's one grammar: fp8 is fp8_e4m3, fp16 float16
        return cls(spec.strip(), fmt.k_dtype, fmt.v_dtype, fmt.scales or default_kv_scale(fmt.k_dtype, fmt.v_dtype)
                   or "token", fmt.rotation or DEFAULT_KV_ROTATION)

    def engine_changes(self) -> dict[str, str]:
        return {"kv_cache_dtype": "auto", "k_cache_dtype": self.k_cache_dtype,
                "v_cache_dtype": self.v_cache_dtype, "kv_cache_scale": self.kv_cache_scale,
                "kv_cache_rotation": self.kv_cache_rotation}


@dataclass
class EvalOptions:
    contexts: tuple[int, ...] = (256, 1024, 2048)
    windows: int = 1  # windows of text scored per context length
    num_prompts: int = 20
    prompt_tokens: int = 32
    gen_tokens: int = 128
    capacity_memory: int = 1 << 30  # KV memory the capacity columns are priced at
    capacity_seq_len: int = 2048
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # tokens per scoring pass: bounds memory at any context

    def __post_init__(self) -> None:
        for name in ("windows", "num_prompts", "prompt_tokens", "gen_tokens", "capacity_seq_len", "prefill_chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.contexts or any(not isinstance(c, int) or c < 2 for c in self.contexts):
            raise ValueError(f"contexts must be integers >= 2, got {self.contexts!r}")


@dataclass
class RowResult:
    spec: str
    k_dtype: str
    v_dtype: str
    scale: str | None
    bytes_per_token: float
    blocks: int  # blocks in options.capacity_memory
    sequences: int  # full capacity_seq_len sequences in options.capacity_memory
    perplexity: dict[int, float] = field(default_factory=dict)
    depth: list[float] = field(default_factory=list)  # perplexity of each quarter of the longest context's windows
    kl: float = 0.0
    step_agreement: float = 1.0
    same_prefix: float = 1.0  # mean fraction of gen_tokens before the first difference
    rotation: str | None = None  # "hadamard": quantized sides stored rotated (rows saved before it: None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["perplexity"] = {str(k): v for k, v in self.perplexity.items()}
        return d


def corpus_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of CPython's documentation topics (sorted by name), as one text."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    chars = max(4 * num_tokens, 4096)
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) >= num_tokens or chars >= len(text):
            break
        chars *= 2
    if len(ids) < num_tokens:
        raise ValueError(f"contexts x windows need {num_tokens} tokens; the documentation text has {len(ids)}")
    return ids[:num_tokens]


def corpus_windows(tokenizer, context: int, count: int) -> list[list[int]]:
    """`count` consecutive windows of `context` tokens of the documentation, each opening with `bos_prefix`."""
    bos = bos_prefix(tokenizer)
    body = context - len(bos)
    corpus = corpus_token_ids(tokenizer, body * count)
    return [bos + corpus[w * body : (w + 1) * body] for w in range(count)]


def prompt_token_ids(tokenizer, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """The head of `num_prompts` topics spread evenly over the sorted topic names (after `bos_prefix`)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    if num_prompts > len(names):
        raise ValueError(f"num_prompts must be <= {len(names)} (one topic each), got {num_prompts}")
    picks = [names[(i * len(names)) // num_prompts] for i in range(num_prompts)]
    bos = bos_prefix(tokenizer)
    body = prompt_tokens - len(bos)
    return [bos + tokenizer.encode(topics[n][: 8 * prompt_tokens], add_special_tokens=False)[:body] for n in picks]


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def _nll_sum(logp: torch.Tensor, ids: list[int]) -> float:
    target = torch.tensor(ids[1:])
    return -float(logp[:-1].gather(1, target[:, None]).sum())


_kl_sum = kl_sum  # the one-pass helpers the weight-quantization eval shares (weight_quant_eval.py)


class KVQuantEval:
    """Runs the measurements for each variant on one loaded engine; `auto` is the reference."""

    def __init__(self, engine, options: EvalOptions) -> None:
        self.engine, self.opts = engine, options
        tok = engine.tokenizer
        if tok is None:
            raise ValueError("kvforge eval kv-quant needs a model with a tokenizer")
        max_len = engine.scheduler_config.max_model_len
        if max(options.contexts) > max_len:
            raise ValueError(f"contexts: {max(options.contexts)} exceeds the model's max_model_len {max_len}")
        self.windows = {c: corpus_windows(tok, c, options.windows) for c in options.contexts}
        self.prompts = prompt_token_ids(tok, options.num_prompts, options.prompt_tokens)
        self.greedy = SamplingParams(temperature=0, max_tokens=options.gen_tokens, ignore_eos=True)
        self.base_logp: dict[tuple[int, int], torch.Tensor] = {}  # the reference's kept log-probabilities
        self.base_outputs: list[list[int]] = []

    def _generate(self) -> list[list[int]]:
        eng = self.engine
        ids = [eng.add_request(None, self.greedy, p) for p in self.prompts]
        done: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return [done[i] for i in ids]

    def run_variant(self, variant: Variant, on_measure=None) -> RowResult:  # type: ignore[no-untyped-def]
        """Measure one variant; `on_measure()` is called after each of its `measurements_per_row` steps."""
        eng, opts = self.engine, self.opts
        tick = on_measure or (lambda: None)
        eng.reconfigure_kv_cache(**variant.engine_changes())
        fmt: KVCacheFormat = eng.cache_format
        shape, bs = eng.model_config.kv_shape(), eng.kv.block_size
        row = RowResult(
            variant.spec, fmt.k_dtype, fmt.v_dtype, fmt.scale_granularity,
            kv_bytes_per_token(shape, fmt, bs),
            num_blocks_for_memory(opts.capacity_memory, shape, bs, fmt) - NULL_BLOCKS_PER_GROUP,  # the pool's usable
            max_concurrency(opts.capacity_memory, shape, opts.capacity_seq_len, fmt, bs),
            rotation=fmt.rotation,
        )
        reference = not self.base_logp
        kl_total, kl_count = 0.0, 0
        longest = max(self.windows)
        for c, windows in self.windows.items():
            nll, n, deep = 0.0, 0, []
            for w, ids in enumerate(windows):
                score = score_window(eng, ids, opts.prefill_chunk)
                nll, n = nll + score.nll_sum, n + len(ids) - 1
                deep.append(score.nll)
                if reference:
                    self.base_logp[(c, w)] = score.logp
                else:
                    kl_total += kl_sum(self.base_logp[(c, w)], score.logp)
                    kl_count += score.logp.shape[0]
                tick()
            row.perplexity[c] = math.exp(nll / n)
            if c == longest:
                quarters = [depth_perplexity(d) for d in deep]  # mean NLL per quarter over the windows
                row.depth = [math.exp(sum(math.log(q[i]) for q in quarters) / len(quarters)) for i in range(4)]
        row.kl = kl_total / kl_count if kl_count else 0.0
        outputs = self._generate()
        tick()
        if reference:
            self.base_outputs = outputs
            return row
        agree, prefix = 0, 0.0
        for prompt, base, mine in zip(self.prompts, self.base_outputs, outputs):
            logits = eng.prompt_logits(prompt + base[:-1])  # teacher-forced along the reference greedy path
            picks = logits[len(prompt) - 1 :].argmax(dim=-1).tolist()
            agree += sum(int(a == b) for a, b in zip(picks, base))
            first = next((i for i, (a, b) in enumerate(zip(mine, base)) if a != b), len(base))
            prefix += first / len(base)
            tick()
        row.step_agreement = agree / (len(self.prompts) * opts.gen_tokens)
        row.same_prefix = prefix / len(self.prompts)
        return row


def measured_variants(variants: list[Variant]) -> list[Variant]:
    """The rows measured: the unquantized ("auto") reference first, then each quantized variant."""
    return [Variant.parse("auto")] + [v for v in variants if (v.k_cache_dtype, v.v_cache_dtype) != ("auto", "auto")]


def measurement_count(num_rows: int, options: EvalOptions) -> int:
    """Progress units of a run: per row, each scored window and the greedy run; per compared row, each prompt."""
    return num_rows * (len(options.contexts) * options.windows + 1) + (num_rows - 1) * options.num_prompts


def run_kv_quant_eval(engine, variants: list[Variant], options: EvalOptions, progress=None,  # type: ignore[no-untyped-def]
                      on_measure=None) -> list[RowResult]:
    """Measure every variant (`measured_variants`); `progress(row)` after each row, `on_measure()` after each step."""
    ev = KVQuantEval(engine, options)
    rows = []
    for v in measured_variants(variants):
        rows.append(ev.run_variant(v, on_measure))
        if progress is not None:
            progress(rows[-1])
    engine.check_integrity()
    return rows
