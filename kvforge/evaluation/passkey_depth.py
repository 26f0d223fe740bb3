"""Passkey at depth and length: `kvforge eval kv-evict --passkey-lengths ...`.

The plain kv-evict eval hides its key early (10% depth) in ~1.1K tokens. Long-context eviction is a
question of where the fact sits and how far away the question is, so this mode builds prompts of each
requested length (4K, 8K, 16K tokens of CPython's documentation) with the key at each requested depth
(the share of the document before the key: 10% near the start, 90% just before the question) and asks
for it at the end. Each policy (the full cache first, then streaming, h2o, snapkv) answers every prompt
at every budget (fixed token counts, or a share of the prompt). The prompts of one length share their
filler across depths, and the budgets of one prompt share its prefill through the prefix cache (eviction
cuts only after the prompt), so the budgets cost little more than one. The engine prefills in chunks of
its `max_num_batched_tokens`, so memory stays bounded at any length.

A policy the engine refuses for this model (a model whose every layer is windowed refuses every eviction
policy; hybrid models such as Gemma 3 evict in their full-attention layers) is reported as refused, with
the engine's reason, and the others still run. Prompts open with the tokenizer's <bos> where it adds one.
With the kvpress referee (`--kvpress-python`), kvpress's presses answer the same prompts at the same
budgets in transformers (`add_referee_cells`), beside transformers' own full cache.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvforge.engine.sampling_params import SamplingParams
from kvforge.evaluation.kv_evict import POLICIES, budget_tokens, found_key, passkey_ids, passkey_parts
from kvforge.evaluation.kv_quant import corpus_token_ids

ANSWER_TOKENS = 8
FULL = "full cache"
REFEREE_FULL = "transformers full cache"  # the kvpress referee's own full-cache row (kv_evict_referee.py)


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: list[int]
    key: str
    needle_start: int  # index of the needle's first token in `ids`
    needle_len: int
    depth: int  # requested, percent of the document before the needle
    length: int


def depth_prompt(tokenizer, filler: list[int], key: str, length: int, depth: int) -> PasskeyPrompt:
    """`length` tokens: the intro, the document with the needle after `depth`% of it, the question."""
    parts = passkey_parts(tokenizer, key)
    room = length - sum(map(len, parts))
    if room < 1 or len(filler) < room:
        raise ValueError(f"a {length}-token passkey prompt needs {max(room, 1)} filler tokens")
    cut = round(room * depth / 100)
    return PasskeyPrompt(passkey_ids(parts, filler[:room], cut), key, len(parts[0]) + cut, len(parts[1]), depth, length)


def build_prompts(tokenizer, lengths: tuple[int, ...], depths: tuple[int, ...],
                  per_depth: int) -> list[PasskeyPrompt]:
    """`per_depth` prompts per (length, depth); prompt i of a length uses the same filler at every depth."""
    rng = random.Random(4545)
    corpus = corpus_token_ids(tokenizer, max(lengths) * per_depth)
    out = []
    for length in lengths:
        for i in range(per_depth):
            filler = corpus[i * max(lengths) : i * max(lengths) + length]
            out += [depth_prompt(tokenizer, filler, str(rng.randint(10000, 99999)), length, d) for d in depths]
    return out


@dataclass
class DepthCell:
    policy: str
    budget: str  # "100%" for the full cache
    length: int
    depth: int
    found: int = 0
    total: int = 0
    kept_tokens: int = 0  # the budget in tokens for this length (the prompt for the full cache)
    answers: list[str] = field(default_factory=list)  # the greedy answer to each prompt, as text


@dataclass
class DepthResult:
    depths: tuple[int, ...]
    lengths: tuple[int, ...]
    budgets: tuple[str, ...]
    per_depth: int
    cells: list[DepthCell] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # policy -> the engine's reason

    def found(self, policy: str, budget: str, length: int, depth: int | None = None) -> tuple[int, int]:
        mine = [c for c in self.cells if (c.policy, c.budget, c.length) == (policy, budget, length)
                and (depth is None or c.depth == depth)]
        return sum(c.found for c in mine), sum(c.total for c in mine)

    def to_dict(self) -> dict:
        return asdict(self)


def merge_results(saved: list[dict]) -> DepthResult:
    """One result from the JSON of several runs (e.g. one process per length on a shared machine): their
    lengths side by side; each run's own depths, budgets and prompts per depth must be the same."""
    first = saved[0]
    for other in saved[1:]:
        if (other["depths"], other["budgets"], other["per_depth"]) != (first["depths"], first["budgets"],
                                                                         first["per_depth"]):
            raise ValueError("runs to merge must share their depths, budgets and prompts per depth")
    result = DepthResult(tuple(first["depths"]), tuple(n for d in saved for n in d["lengths"]),
                         tuple(first["budgets"]), first["per_depth"])
    for d in saved:
        result.cells += [DepthCell(**c) for c in d["cells"]]
        result.refused.update(d["refused"])
    return result


def _answers(engine, prompts: list[PasskeyPrompt], budgets: list[int | None]) -> list[list[str]]:
    """For each prompt, each budget's answer as text. A prompt's budgets run together, so the later ones
    hit the first one's prompt blocks in the prefix cache."""
    out = []
    for p in prompts:
        params = [SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True, kv_budget=b) for b in budgets]
        ids = [engine.add_request(None, sp, p.ids) for sp in params]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        out.append([engine.tokenizer.decode(done[i]) for i in ids])
    return out


def run_passkey_depth(engine, depths: tuple[int, ...], lengths: tuple[int, ...], budgets: tuple[str, ...],
                      policies: tuple[str, ...] = POLICIES, per_depth: int = 2,
                      progress: Callable[[str], None] | None = None,
                      on_update: Callable[[DepthResult], None] | None = None) -> DepthResult:
    """The full cache, then each policy at each budget, on every (length, depth) prompt; `on_update(result)`
    after each prompt (cells not yet measured have total 0), so a long run can save as it goes."""
    limit = engine.scheduler_config.max_model_len
    for n in lengths:
        if n + ANSWER_TOKENS > limit:
            raise ValueError(f"--passkey-lengths {n}: a prompt plus {ANSWER_TOKENS} answer tokens must fit "
                             f"max_model_len {limit}")
    result = DepthResult(depths, lengths, budgets, per_depth)
    prompts = build_prompts(engine.tokenizer, lengths, depths, per_depth)
    bs = engine.kv.block_size
    for policy in (FULL, *policies):
        try:
            if policy == FULL:
                engine.reconfigure_kv_cache(kv_eviction="none", kv_budget=None)
            else:
                top = max(budget_tokens(b, n, bs) for b in budgets for n in lengths)
                engine.reconfigure_kv_cache(kv_eviction=policy, kv_budget=top)
        except ValueError as exc:
            result.refused[policy] = str(exc)
            if progress is not None:
                progress(f"{policy}: refused ({exc})")
            continue
        labels = ["100%"] if policy == FULL else list(budgets)
        cells = {(b, n, d): DepthCell(policy, b, n, d) for b in labels for n in lengths for d in depths}
        result.cells += cells.values()
        for p in prompts:
            kept = [None] if policy == FULL else [budget_tokens(b, p.length, bs) for b in budgets]
            texts = _answers(engine, [p], kept)[0]
            answers = [found_key(text, p.key) for text in texts]
            for label, b, ok, text in zip(labels, kept, answers, texts):
                cell = cells[(label, p.length, p.depth)]
                cell.found, cell.total = cell.found + int(ok), cell.total + 1
                cell.kept_tokens = p.length if b is None else b
                cell.answers.append(f"key {p.key}: {text!r}")
            if progress is not None:  # each answer, so a run stopped early still tells what it measured
                progress(f"{policy} {p.length} tokens, key at {p.depth}%: "
                         + " ".join(f"{label}={'found' if ok else 'missed'}" for label, ok in zip(labels, answers)))
            if on_update is not None:
                on_update(result)
    engine.reconfigure_kv_cache(kv_eviction="none", kv_budget=None)
    return result


def add_referee_cells(result: DepthResult, prompts: list[PasskeyPrompt], answers: list[dict], decode,
                      block_size: int) -> None:  # type: ignore[no-untyped-def]
    """The kvpress referee's rows (`kv_evict_referee.run_referee`: one per press and budget, the greedy ids
    of every prompt in `prompts`' order) as cells beside kvforge's, found by the same `found_key`. A press
    that failed (missing, refused, out of memory) is listed with its error as refused."""
    for a in answers:
        budget = a.get("budget") or "100%"
        if a.get("error"):
            result.refused[f"{a['policy']} @ {budget}"] = a["error"]
            continue
        cells: dict[tuple[int, int], DepthCell] = {}
        for p, ids in zip(prompts, a["passkey_ids"]):
            cell = cells.setdefault((p.length, p.depth), DepthCell(a["policy"], budget, p.length, p.depth))
            text = decode(ids)
            cell.found += int(found_key(text, p.key))
            cell.total += 1
            cell.kept_tokens = p.length if budget == "100%" else budget_tokens(budget, p.length, block_size)
            cell.answers.append(f"key {p.key}: {text!r}")
        result.cells += cells.values()


def reference_policy(result: DepthResult, policy: str) -> tuple[str, str]:
    """The full-cache row a policy's 'of full' share is taken against: kvpress rows against transformers'
    own full cache when the referee ran one, kvforge's rows against kvforge's."""
    if policy.startswith("kvpress") and any(c.policy == REFEREE_FULL for c in result.cells):
        return REFEREE_FULL, "100%"
    return FULL, "100%"


def _count(found: int, total: int) -> str:
    return f"{found}/{total}" if total else "–"  # –: not measured (a run stopped early)


def _ratio(found: int, full: int) -> str:
    return "–" if full == 0 else f"{100 * found / full:.0f}%"


def render_depth_table(result: DepthResult, model: str) -> str:
    """Keys found per (policy, budget) row, one column per (length, depth), with each length's share of
    the keys the full cache found."""
    r = result
    lines = [f"kvforge eval kv-evict, passkey at depth and length  {model}",
             f"  {r.per_depth} prompt(s) per (length, depth); cells: keys found / prompts; 'of full': keys found "
             f"as a share of those the full cache found at that length", ""]
    head = ["policy", "budget"]
    for n in r.lengths:
        head += [f"{n}@{d}%" for d in r.depths] + [f"{n} all", f"{n} of full"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(FULL, "100%")] + [pb for pb in dict.fromkeys((c.policy, c.budget) for c in r.cells) if pb[0] != FULL]
    for policy, budget in rows:
        cells = [policy, budget]
        for n in r.lengths:
            cells += [_count(*r.found(policy, budget, n, d)) for d in r.depths]
            found, total = r.found(policy, budget, n)
            kept = next((c.kept_tokens for c in r.cells if (c.policy, c.budget, c.length) == (policy, budget, n)), n)
            measured = [d for d in r.depths if r.found(policy, budget, n, d)[1]]  # a run stopped early: fewer
            full = sum(r.found(*reference_policy(r, policy), n, d)[0] for d in measured)
            cells += [_count(found, total) + (f" ({kept} kept)" if budget != "100%" else ""),
                      _ratio(found, full) if total else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    for policy, why in r.refused.items():
        lines.append(f"\n{policy}: refused by the engine for this model: {why}")
    return "\n".join(lines)


def save_depth_plot(result: DepthResult, path: str) -> None:
    """One panel per length: share of keys found against depth, a line per policy and budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result
    fig, axes = plt.subplots(1, len(r.lengths), figsize=(5.5 * len(r.lengths), 4.2), squeeze=False)
    colors = {FULL: "black", "streaming": "tab:blue", "h2o": "tab:orange", "snapkv": "tab:green",
              REFEREE_FULL: "grey", "kvpress StreamingLLM": "tab:cyan", "kvpress ObservedAttention (H2O)": "tab:brown",
              "kvpress SnapKV (w=64)": "tab:olive"}
    styles = ["-", "--", ":", "-."]
    series = [(FULL, "100%")] + [pb for pb in dict.fromkeys((c.policy, c.budget) for c in r.cells) if pb[0] != FULL]
    for ax, n in zip(axes[0], r.lengths):
        for policy, budget in series:
            ys = [r.found(policy, budget, n, d) for d in r.depths]
            if not all(t for _, t in ys):  # not (fully) measured
                continue
            style = "-" if budget == "100%" else styles[r.budgets.index(budget) % len(styles)]
            ax.plot(r.depths, [100 * f / t for f, t in ys], marker="o", color=colors.get(policy), ls=style,
                    lw=2.5 if policy == FULL else 1.5, label=policy if budget == "100%" else f"{policy} @ {budget}")
        ax.set_title(f"{n}-token prompts" + (f" (refused: {', '.join(r.refused)})" if r.refused else ""), fontsize=9)
        ax.set_xlabel("key depth (% of the document)")
        ax.set_ylabel("keys found (%)")
        ax.set_ylim(-5, 105)
        ax.set_xticks(list(r.depths))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
