"""Engine logprobs (per token: {token id: logprob}, chosen included) in OpenAI's two JSON shapes."""
from __future__ import annotations

from kvforge.tokenizer import Tokenizer


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def _text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _top_by_text(tok: Tokenizer, entry: dict[int, float], k: int) -> dict[str, float]:
    """The top k keyed by text; ids that decode alike (e.g. partial UTF-8) keep the likelier one's logprob."""
    out: dict[str, float] = {}
    for t, lp in _top(entry, k):
        out.setdefault(_text(tok, t), lp)
    return out


def completion_logprobs(tok: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float] | None], k: int) -> dict:
    """/v1/completions: parallel lists tokens / token_logprobs / top_logprobs / text_offset (an echoed prompt's
    first token has no entry: null logprob and null top_logprobs)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = 0
    for tid, entry in zip(token_ids, logprobs):
        text = _text(tok, tid)
        tokens.append(text)
        token_lps.append(entry.get(tid) if entry is not None else None)
        tops.append(_top_by_text(tok, entry, k) if k > 0 and entry is not None else None)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
    """/v1/chat/completions: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for tid, entry in zip(token_ids, logprobs):
        text = _text(tok, tid)
        content.append({
            "token": text, "logprob": entry.get(tid), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := _text(tok, i)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                for i, lp in _top(entry, k)
            ],
        })
    return {"content": content}
