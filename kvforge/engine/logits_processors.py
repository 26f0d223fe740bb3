"""Per-request logits processing before sampling: penalties, logit_bias, allowed_token_ids, bad_words.

Semantics, all as vLLM applies them:
  - repetition_penalty (transformers' `RepetitionPenaltyLogitsProcessor`): every token seen in the prompt or
    the output has its logit divided by the penalty when positive, multiplied by it when negative;
  - frequency_penalty and presence_penalty (OpenAI's formula, over generated tokens only):
    logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty;
  - logit_bias: {token id: bias} added to the logits (+-100 forces or bans a token in practice);
  - allowed_token_ids: every other token is masked to -inf;
  - bad_words: a word of one token is never sampled; a longer one has its last token masked when the output
    ends with the rest of it.

Everything is built once per step as a few [B, V] tensors (scatter from the rows' token ids), so the cost is
one pass over the batch's histories, never a Python loop over the vocabulary. A row is processed from its own
request's tokens only, so seeded sampling stays batch-invariant. Rows that ask for nothing cost nothing.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.engine.sampling_params import SamplingParams


def needs_processing(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
                or p.allowed_token_ids is not None or p.bad_words_token_ids)


def apply_logits_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                            histories: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
    """logits [B, V] (changed in place and returned); histories[i] = (prompt ids, output ids) of row i."""
    rows = [i for i, p in enumerate(params) if needs_processing(p)]
    if not rows:
        return logits
    _penalties(logits, [params[i] for i in rows], [histories[i] for i in rows], rows)
    _bias_and_masks(logits, [params[i] for i in rows], [histories[i][1] for i in rows], rows)
    return logits


def _id_matrix(seqs: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0) or 1
    return torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.int64, device=device)


def _penalties(logits: torch.Tensor, params: list[SamplingParams],
               histories: list[tuple[Sequence[int], Sequence[int]]], rows: list[int]) -> None:
    """Gather / scatter over each row's own token ids: O(batch x history), never a pass over the vocabulary."""
    vocab, dev = logits.shape[-1], logits.device
    whole = rows == list(range(logits.shape[0]))
    sub = logits if whole else logits[rows]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    if (rep != 1.0).any():  # padded with each row's first id: a duplicate writes the same value
        seen = [list(pr) + list(out) for pr, out in histories]
        ids = _id_matrix(seen, -1, dev)
        ids = torch.where(ids < 0, ids[:, :1], ids)
        vals = sub.gather(1, ids)
        sub.scatter_(1, ids, torch.where(vals > 0, vals / rep, vals * rep))
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    if ((freq != 0) | (pres != 0)).any():
        ids = _id_matrix([out for _, out in histories], vocab, dev).sort(dim=1).values  # padding (vocab) last
        real = ids < vocab
        first = torch.ones_like(real)
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]  # one presence per distinct token
        delta = -(freq * real.to(sub.dtype) + pres * (first & real).to(sub.dtype))
        sub.scatter_add_(1, torch.where(real, ids, 0), delta)
    if not whole:
        logits[rows] = sub


def _bias_and_masks(logits: torch.Tensor, params: list[SamplingParams], outputs: list[Sequence[int]],
                    rows: list[int]) -> None:
    dev = logits.device
    b_rows, b_cols, b_vals = [], [], []
    ban_rows, ban_cols = [], []
    allow_rows, allow_ids = [], []
    for row, p, out in zip(rows, params, outputs):
        for t, v in (p.logit_bias or {}).items():
            b_rows.append(row)
            b_cols.append(t)
            b_vals.append(v)
        if p.allowed_token_ids is not None:
            allow_rows.append(row)
            allow_ids.append(p.allowed_token_ids)
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or (len(out) >= len(prefix) and list(out[len(out) - len(prefix):]) == list(prefix)):
                ban_rows.append(row)
                ban_cols.append(word[-1])
    if b_rows:
        vals = torch.tensor(b_vals, dtype=logits.dtype, device=dev)
        logits.index_put_((torch.tensor(b_rows, device=dev), torch.tensor(b_cols, device=dev)), vals, accumulate=True)
    if allow_rows:
        vocab = logits.shape[-1]
        keep = torch.zeros(len(allow_rows), vocab + 1, dtype=torch.bool, device=dev)
        keep.scatter_(1, _id_matrix(allow_ids, vocab, dev), True)
        idx = torch.tensor(allow_rows, device=dev)
        logits[idx] = logits[idx].masked_fill(~keep[:, :vocab], float("-inf"))
    if ban_rows:
        logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)] = float("-inf")


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each bad word as token ids, alone and after a space (how it appears mid-text), without duplicates."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out
