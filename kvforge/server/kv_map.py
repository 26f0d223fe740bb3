"""`/kv`, `/kv/state`, `/kv/stream`: the live KV block map of a running server.

Why these shapes: the page (`static/kv_map.html`, plain HTML/CSS/JS, no CDN, no build step)
needs one consistent snapshot to draw and then a stream of newer ones; `kvforge top` and
scripts need the same JSON. Snapshots are built on the engine thread between two steps
(`AsyncEngine.call`), so the loop stops only for one pass over the pools. The hub below shares
one snapshot between every viewer of the same step and paces itself: at most `max_rate`
snapshots a second, and never more often than keeps the engine thread's share under
`max_duty` (a 100k-block pool, whose pass takes tens of ms, is refreshed less often, not slower).

Auth: every route is behind the API key. A browser cannot add an `Authorization` header to a
page load or an EventSource, so `/kv?key=K` checks the key once, stores it in an HttpOnly,
SameSite=Strict cookie scoped to `/kv`, and redirects to `/kv` (the key leaves the address
bar and the history). The three routes accept the header or that cookie.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from kvforge.server.async_engine import AsyncEngine
from kvforge.server.auth import check_bearer
from kvforge.server.protocol import APIError

COOKIE = "kvforge_api_key"
DEFAULT_MAX_RATE = 10.0  # snapshots a second, at most, whatever the viewers ask
DEFAULT_MAX_DUTY = 0.02  # share of the engine thread's time snapshots may take
KEEPALIVE_S = 15.0


INITIAL_STATE_MARK = "__KV_INITIAL_STATE__"


def page_html(initial: dict[str, Any] | None = None) -> str:
    """The page, with `initial` (a snapshot) embedded so its first picture needs no second request.

    `</` is escaped so no request id can close the script element the JSON sits in."""
    page = resources.files("kvforge.server").joinpath("static/kv_map.html").read_text(encoding="utf-8")
    data = json.dumps(initial, separators=(",", ":")).replace("</", "<\\/") if initial is not None else ""
    return page.replace(INITIAL_STATE_MARK, data, 1)


class KVMapHub:
    """One snapshot per engine step, shared by every viewer, paced by `max_rate` and `max_duty`.

    `clock` and `sleep` are the hub's time (`time.monotonic`, `asyncio.sleep`); a test passes a fake
    pair to check the pace without waiting on the wall clock."""

    def __init__(self, engine: AsyncEngine, max_rate: float = DEFAULT_MAX_RATE,
                 max_duty: float = DEFAULT_MAX_DUTY, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if max_rate <= 0 or not 0 < max_duty <= 1:
            raise ValueError("max_rate must be > 0 and max_duty in (0, 1]")
        self.engine = engine
        self.min_interval = 1.0 / max_rate
        self.max_duty = max_duty
        self.clock, self.sleep = clock, sleep
        self.build_seconds = 0.0  # the last snapshot's cost on the engine thread
        self._cached: tuple[tuple[int, int], bytes] | None = None
        self._lock = asyncio.Lock()
        self.num_built = 0

    @property
    def interval(self) -> float:
        """Seconds between two snapshots: the rate limit, or longer when a snapshot is costly."""
        return max(self.min_interval, self.build_seconds / self.max_duty)

    def _version(self) -> tuple[int, int]:
        kv_map = self.engine.engine.kv_map  # two ints read from another thread: a hint, re-read on the engine
        return kv_map.step, kv_map.events.next_seq

    async def snapshot(self, since: int | None = None) -> dict[str, Any]:
        """A fresh snapshot (the `/kv/state` route), with the events from sequence `since` on."""
        def build(e: Any) -> tuple[dict[str, Any], float]:
            t0 = self.clock()
            snap = e.kv_map.snapshot(e, since)
            return snap, self.clock() - t0

        snap, seconds = await self.engine.call(build)
        self.build_seconds = seconds
        self.num_built += 1
        return snap

    async def encoded(self) -> bytes:
        """The current step's snapshot as JSON, built once for all viewers of that step."""
        async with self._lock:
            version = self._version()
            if self._cached is not None and self._cached[0] == version:
                return self._cached[1]
            snap = await self.snapshot()
            data = json.dumps(snap, separators=(",", ":")).encode()
            self._cached = ((snap["step"], snap["next_event"]), data)
            return data

    async def stream(self, interval: float | None = None) -> AsyncIterator[bytes]:
        """Server-sent events: `snapshot` whenever the engine moved, a comment line to keep the link alive."""
        sent: tuple[int, int] | None = None
        last_send = self.clock()
        while True:
            version = self._version()
            if version != sent:
                data = await self.encoded()
                sent = version
                last_send = self.clock()
                yield b"event: snapshot\ndata: " + data + b"\n\n"
            elif self.clock() - last_send > KEEPALIVE_S:
                last_send = self.clock()
                yield b": keep-alive\n\n"
            await self.sleep(max(self.interval, interval or 0.0))


def add_kv_map_routes(app: FastAPI, engine: AsyncEngine, api_key: str | tuple[str, ...] | None,
                      hub: KVMapHub | None = None) -> KVMapHub:
    """Register the three routes on `app`; returns the hub (tests read its counters)."""
    hub = hub or KVMapHub(engine)
    app.state.kv_map_hub = hub

    def check(request: Request) -> None:
        if api_key is None:
            return
        if request.headers.get("authorization"):
            check_bearer(request.headers.get("authorization"), api_key)
            return
        check_bearer(f"Bearer {request.cookies.get(COOKIE, '')}", api_key)

    @app.get("/kv", include_in_schema=False)
    async def kv_page(request: Request) -> Response:
        key = request.query_params.get("key")
        if key is not None and api_key is not None:
            check_bearer(f"Bearer {key}", api_key)
            response = RedirectResponse("kv", status_code=303)
            response.set_cookie(COOKIE, key, httponly=True, samesite="strict", path="/kv")
            return response
        check(request)
        return HTMLResponse(page_html(await hub.snapshot()), headers={"Cache-Control": "no-store"})

    @app.get("/kv/state")
    async def kv_state(request: Request, since: int | None = None) -> JSONResponse:
        """The block map now: every group's pool, each request's tables, gauges, and events from `since`."""
        check(request)
        if since is not None and since < 0:
            raise APIError("'since' must be >= 0", param="since")
        return JSONResponse(await hub.snapshot(since))

    @app.get("/kv/stream")
    async def kv_stream(request: Request, interval: float | None = None) -> StreamingResponse:
        """Server-sent `snapshot` events, at most 10 a second (or one every `interval` seconds)."""
        check(request)
        if interval is not None and not 0 <= interval <= 3600:
            raise APIError("'interval' must be in [0, 3600] seconds", param="interval")
        return StreamingResponse(hub.stream(interval), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return hub
