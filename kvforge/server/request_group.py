"""What one API call waits on: its sub-requests' outputs, delivered by the engine thread.

Kept apart from the engine loop so the asyncio side (queue, iteration, abort)
reads on its own; every method here except `_put` runs on the caller's loop.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SamplingParams


class Aborts(Protocol):
    """What a group needs of the engine loop (`AsyncEngine`): withdrawing its requests. A Protocol, so
    this module does not import async_engine back."""

    def abort(self, request_ids: list[str]) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine cannot take this request: it stopped after an internal error, or the server is shutting down.

    `code` is the error code the client sees; a drain says `draining`, as /health does.
    """

    def __init__(self, message: str, code: str = "engine_unavailable") -> None:
        super().__init__(message)
        self.code = code


class ServerBusyError(RuntimeError):
    """The waiting queue is full (`--max-waiting-requests`): HTTP 503 with Retry-After."""


class RequestFailedError(RuntimeError):
    """This request hit an internal error in the engine and was failed alone; the engine keeps serving."""


@dataclass
class SubRequest:
    """One engine request: one prompt with all its samples (`params.n`), which share the prompt's blocks."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class RequestGroup:
    """The outputs of the sub-requests of one API call, in step order, on the caller's loop."""

    def __init__(self, engine: Aborts, subs: list[SubRequest]) -> None:
        self.engine = engine
        self.subs = subs
        self.index = {s.request_id: i for i, s in enumerate(subs)}
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.unfinished = set(self.index)

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (sub-request index, output) until every sub-request has finished (all its samples)."""
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield self.index[item.request_id], item

    def abort(self) -> None:
        """Withdraw whatever has not finished (safe to call twice, and from any coroutine)."""
        if self.unfinished:
            self.engine.abort(list(self.unfinished))
            self.unfinished.clear()


def resolve_future(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    """Complete an asyncio future from the engine thread."""

    def settle() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    try:
        fut.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass
