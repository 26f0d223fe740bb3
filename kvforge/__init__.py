"""kvforge: an LLM inference engine built around the KV cache."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import kvforge.ledger` (the planner) never pays for torch.
    if name == "LLM":
        from kvforge.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kvforge.engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from kvforge.engine.structured.params import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(name)
