"""The engine's side of structured outputs: one llguidance matcher per constrained sample.

Lifecycle, all on the engine thread:
- `add` when a request is queued (a cached grammar is only copied; a new one compiles here,
  bounded by the compiler's limits; the server compiles first on a worker thread);
- `fork` when an n > 1 request splits into samples: each sample gets its own copy;
- `fill` each step: the bitmasks of the constrained rows, filled by llguidance's batched
  executor in one call;
- `advance` once the sampled token is appended: the matcher consumes it, and a grammar that
  cannot continue ends the request ("stop").
A preempted request keeps its matcher: it keeps its output tokens too, so the two agree.
"""
from __future__ import annotations

import logging
from typing import Any

import llguidance
import torch

from kvforge.engine.request import Request
from kvforge.engine.structured.bitmask import bitmask_words
from kvforge.engine.structured.compiler import GrammarCompiler
from kvforge.engine.structured.params import StructuredOutputsParams

log = logging.getLogger("kvforge.structured")


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: GrammarCompiler | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.matchers: dict[str, llguidance.LLMatcher] = {}  # by sample (request) id
        self._bitmask = torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)
        self.num_masked_rows = 0  # rows masked so far (a counter for tests and benchmarks)

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use: the llguidance tokenizer takes ~0.2-1 s, unconstrained servers never pay it."""
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this engine has none")
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """Thread-safe; a StructuredOutputError (a ValueError naming the field) for a bad constraint."""
        return self.compiler.compile(spec)

    def add(self, req: Request) -> None:
        spec = req.sampling_params.structured_outputs
        if spec is not None:
            self.matchers[req.request_id] = self.compile(spec)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """Samples 1..n-1 start where the parent is (at the prompt's end: nothing consumed yet)."""
        m = self.matchers.get(parent.request_id)
        if m is not None:
            for child in children:
                self.matchers[child.request_id] = m.deep_copy()

    def fill(self, sampling: list[Request]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row indices, [rows, W] int32 bitmask) of the constrained rows of this step's sampling order."""
        if not self.matchers:
            return None
        rows = [i for i, r in enumerate(sampling) if r.request_id in self.matchers]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.empty(len(rows), self._bitmask.shape[1], dtype=torch.int32)
        mask = self._bitmask[: len(rows)]
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        pairs = [(self.matchers[sampling[i].request_id], j) for j, i in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, mask.data_ptr(), mask.shape[1] * 4, len(rows))
        self.num_masked_rows += len(rows)
        return torch.tensor(rows, dtype=torch.int64), mask

    def advance(self, req: Request) -> bool:
        """Feed `req`'s newest token to its matcher; True when the grammar is finished (or broken)."""
        m = self.matchers.get(req.request_id)
        if m is None:
            return False
        if not m.consume_token(req.output_token_ids[-1]):
            log.error("request %s: sampled token %d rejected by its grammar: %s", req.request_id,
                      req.output_token_ids[-1], m.get_error())
            return True
        return m.is_stopped()

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
