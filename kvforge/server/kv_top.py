"""`kvforge top`'s screen: the `/kv/state` snapshot drawn as text lines.

Why text from one function: the curses loop only places these lines, so what the terminal shows
is testable without a terminal, and `--once` prints the same frame for scripts and logs. The
pool bar keeps each state's share of the pool (in use, shared, written, cached, free), the
same states the browser page colours; ASCII only, so any terminal and `tmux capture-pane` read it.
"""
from __future__ import annotations

from typing import Any

BAR_CHARS = (("written", "w"), ("shared", "*"), ("in_use", "="), ("reserved", "r"), ("cached", "c"), ("free", "."))


def pool_bar(counts: dict[str, int], width: int) -> str:
    """A bar of `width` characters, each state's share rounded so the shares fill it exactly."""
    total = sum(counts.values()) or 1
    out, used = [], 0
    for i, (state, ch) in enumerate(BAR_CHARS):
        n = width - used if i == len(BAR_CHARS) - 1 else round(width * counts.get(state, 0) / total)
        n = max(0, min(n, width - used))
        out.append(ch * n)
        used += n
    return "".join(out)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _event_text(e: dict[str, Any]) -> str:
    kind = e["kind"]
    if kind == "admit":
        tokens = e.get("tokens", e["prompt_tokens"])  # a re-admission: prompt + generated so far
        text = (f"{e['request']}: prefix hit {e['cached_tokens']} of {tokens} tokens" if e["cached_tokens"]
                else f"{e['request']}: admitted, no hit ({tokens} tokens)")
        return text + (" (recompute)" if e["recompute"] else "")
    if kind == "preempt":
        return f"{e['request']}: preempted by {e['mode']}"
    if kind == "evict":
        groups = e.get("block_ids", [])
        listed = "; ".join(", ".join(map(str, ids)) + (f", +{e['blocks'] - len(ids)} more" if e["blocks"] > len(ids) else "")
                           for ids in groups if ids)
        return f"{e['request']}: {e['policy']} dropped {e['blocks']} blocks" + (f" ({listed})" if listed else "")
    if kind == "tier_load":
        return f"loaded {len(e['blocks'])} blocks from a tier"
    if kind == "tier_store":
        return f"stored {e['blocks']} blocks in the {e['tier']} tier"
    if kind == "cow":
        return f"copy-on-write block {e['src']} -> {e['dst']} (group {e['group']})"
    if kind == "reclaim":
        return f"reclaimed {e['blocks']} cached blocks (LRU)"
    return kind


def render_frame(snap: dict[str, Any], url: str, width: int = 100, height: int = 40,
                 events: list[dict[str, Any]] | None = None) -> list[str]:
    """The screen's lines, each at most `width` characters, at most `height` of them."""
    width = max(40, width)
    g = snap["gauges"]
    lines = [f"kvforge top  {url}  step {snap['step']}  (q quits)",
             f"used {_pct(g['usage'])}  hit rate {_pct(g['hit_rate'])}  utilization {_pct(g['utilization'])}  "
             f"waste paged {_pct(g['paged_waste'])} / contiguous {_pct(g['contiguous_waste'])}  "
             f"preemptions {snap['preemptions']}  cow {g['cow_copies']}"]
    for group in snap["groups"]:
        c = group["counts"]
        label = f"pool g{group['index']} "
        stats = (f" {group['num_blocks'] - c['free'] - c['cached']}/{group['num_blocks']} held, shared {c['shared']}, "
                 f"cached {c['cached']}, reserved {c['reserved']}")
        bar_width = max(10, width - len(label) - len(stats) - 2)
        lines.append(f"{label}[{pool_bar(c, bar_width)}]{stats}")
    for t in snap["tiers"]:
        frac = t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
        fill = round(20 * frac)
        lines.append(f"{t['name']} tier [{'#' * fill}{'.' * (20 - fill)}] {t['used_bytes'] / 2**20:.1f} of "
                     f"{t['capacity_bytes'] / 2**20:.1f} MiB, stored {t['blocks_stored']}, loaded {t['blocks_loaded']}")
    lines.append("legend: w written this step, * shared, = in use, r reserved (empty), c cached (reusable), . free")
    lines.append("")
    lines.append(f"{'REQUEST':<28} {'STATUS':<8} {'TOKENS':>11} {'BLOCKS':>6} {'CACHED':>6}")
    reqs = snap["requests"]
    room = max(1, (height - len(lines) - 8))
    for r in reqs[:room]:
        blocks = sum(1 for t in r["tables"] for b in t if b >= 0)
        lines.append(f"{r['id'][:28]:<28} {r['status']:<8} {r['num_computed']:>5}/{r['num_tokens']:<5} "
                     f"{blocks:>6} {r['cached_prompt_tokens']:>6}")
    if len(reqs) > room:
        lines.append(f"... {len(reqs) - room} more")
    lines.append("")
    lines.append("EVENTS")
    for e in reversed((events if events is not None else snap["events"])[-max(1, height - len(lines)):]):
        lines.append(f"step {e['step']:>6}  {_event_text(e)}")
    return [line[:width] for line in lines[:height]]
