"""How the HTTP server starts, guards its connections, drains and stops (used by `kvforge serve` and tests).

- Header timeout: a connection that has not sent a complete request head within
  `header_timeout` seconds is closed (slowloris), on its first request and between
  keep-alive requests alike. Body deadlines are the app's (`read_json`, HTTP 408).
- Connection cap: uvicorn's `limit_concurrency` answers 503 past `max_connections`.
- Drain: the first SIGTERM/SIGINT stops admission (new requests and /health get 503),
  lets running requests finish for up to `shutdown_timeout` seconds, then ends every
  remaining one with an OpenAI-style error event and `[DONE]`, and only then closes
  the listener. A second signal exits at once.
- Fatal engine errors make `serve()` return exit code 1, so a supervisor restarts the
  process rather than keeping a server that answers 503 forever.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvforge.server.async_engine import AsyncEngine

log = logging.getLogger("kvforge.server")


@dataclass(frozen=True)
class ServerLimits:
    """The connection-level knobs (`kvforge serve` flags of the same names)."""

    header_timeout: float = 10.0  # seconds to send a complete request head
    keep_alive_timeout: float = 5.0  # idle seconds between keep-alive requests
    max_connections: int | None = None  # concurrent connections before 503 (None: unbounded)
    shutdown_timeout: float = 30.0  # seconds running requests get to finish after SIGTERM

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")


def header_timeout_protocol(timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections that do not finish a request head in `timeout` seconds."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _awaiting: Any = None  # the cycle that was current when the timer was armed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._awaiting:
                self._disarm()  # a new request's head arrived

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._awaiting = self.cycle
            self._head_timer = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            self._head_timer = None
            if self.cycle is self._awaiting and not self.transport.is_closing():
                log.debug("closing %s: no complete request head within %g s", self.client, timeout)
                self.transport.close()

    return HeaderTimeoutProtocol


def uvicorn_config(app: Any, limits: ServerLimits, **kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app, http=header_timeout_protocol(limits.header_timeout), timeout_keep_alive=limits.keep_alive_timeout,
        limit_concurrency=limits.max_connections, timeout_graceful_shutdown=5, **kwargs,
    )


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains the engine before it closes (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.fatal: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        engine.on_fatal = self._on_fatal

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: the first signal drains, a second one exits now."""
        if self.engine.draining or self._loop is None:
            self.force_exit = self.should_exit = True
            return
        log.info("signal %d: draining (up to %g s for running requests)", sig, self.shutdown_timeout)
        self._loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Stop admitting and start the drain; call on the server's loop (or through `request_drain`)."""
        if not self.engine.draining:
            self.engine.draining = True
            asyncio.ensure_future(self._drain())

    def request_drain(self) -> None:
        """Thread-safe `begin_drain` (what SIGTERM does), for servers run off the main thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.begin_drain)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_in_flight:
            log.warning("shutdown timeout: ending %d unfinished requests", self.engine.num_in_flight)
            self.engine.fail_unfinished("the server is shutting down: the request did not finish within "
                                        f"--shutdown-timeout ({self.shutdown_timeout:g} s)")
            while self.engine.num_in_flight and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the last error events and [DONE]s reach their sockets
        self.should_exit = True

    def _on_fatal(self, exc: BaseException) -> None:
        """From the engine thread: the engine cannot continue, so neither can the process."""
        self.fatal = exc
        self.should_exit = True
