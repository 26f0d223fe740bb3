"""Structured outputs (JSON schema, regex, choice, grammar) with llguidance, inside the batched sampler.

`params` says what a request asks for (pure Python), `compiler` turns it into llguidance
matchers (cached by constraint), `manager` keeps one matcher per constrained sample across
the engine's steps, and `bitmask` applies the step's masks to the logits in one tensor op.
"""
from kvforge.engine.structured.params import StructuredOutputError, StructuredOutputsParams

__all__ = ["StructuredOutputError", "StructuredOutputsParams"]
