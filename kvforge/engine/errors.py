"""The engine's own errors, in a module of their own so the parallel executor can raise them.

`LLMEngine.step` tells two failures apart: a step that raised for the requests it held
(`StepFailed`: a server fails those and keeps serving) and an engine that cannot go on
(`EngineFatal`, e.g. a dead tensor-parallel rank: re-raised as is). The executor's
`RankFailure` is an `EngineFatal`; defining both here, below engine.py and parallel/,
keeps the import graph free of the circle engine.py -> parallel -> engine.py.
"""
from __future__ import annotations


class EngineFatal(RuntimeError):
    """The engine itself cannot continue (e.g. a tensor-parallel rank died): `step` raises it unwrapped."""


class StepFailed(RuntimeError):
    """Running a step raised; `request_ids` are the caller requests scheduled in it (the cause is chained)."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"engine step failed for requests {request_ids}")
        self.request_ids = request_ids
