"""What the model runner gives back for a step: the sampled tokens and, when asked, the attention mass.

The runner reads only `SchedulerOutput` and returns only this, so it could live in another process:
KV eviction's scores come back here (`attention_mass`, the rows `SchedulerOutput.attention_scoring`
asked for, summed over the layers) and the engine applies eviction with them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.attention.mass import AttentionMassRequest
from kvforge.engine.sampler import SampleResult
from kvforge.engine.scheduler import AttentionScoring


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampleResult] = field(default_factory=dict)  # request id -> its new token
    attention_mass: AttentionMassRequest | None = None  # filled by every layer; None unless scoring was asked


def mass_for(scoring: AttentionScoring) -> AttentionMassRequest:
    """The per-step accumulator the layers fill (`AttentionMetadata.attention_mass`) for `scoring`'s rows."""
    return AttentionMassRequest(scoring.decodes, list(scoring.prefill_rows), block_size=scoring.block_size,
                                per_head=scoring.per_head)
