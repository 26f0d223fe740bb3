"""FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Bodies are read and parsed by hand (size limit, JSON errors) so every failure
has an OpenAI-style error body. A client that goes away is noticed two ways:
a streaming response is cancelled by Starlette and its generator closed; a
non-streaming one races a disconnect watcher. Either way the request's group
is aborted, and the engine frees its blocks at the next step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvforge.server.async_engine import AsyncEngine
from kvforge.server.auth import check_bearer
from kvforge.server.config import DEFAULT_MAX_REQUEST_BYTES
from kvforge.server.protocol import APIError, GenerationRequest, parse_chat_request, parse_completion_request
from kvforge.server.serving import OpenAIServing

log = logging.getLogger("kvforge.server")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator and runs `on_close`, even if never started."""

    def __init__(self, gen: Any, on_close: Any) -> None:
        super().__init__(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._gen, self._on_close = gen, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._gen.aclose()
            self._on_close()


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(f"the request body is {length} bytes; the limit is {limit}", status=413, code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(f"the request body exceeds the limit of {limit} bytes", status=413, code="request_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from exc


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The ASGI app; `engine` must be started (and is shut down by the caller, not here)."""
    app = FastAPI(title="kvforge", docs_url=None, redoc_url=None, openapi_url=None)
    serving = OpenAIServing(engine, model_name)
    app.state.engine, app.state.serving = engine, serving
    created = int(time.time())

    async def authorized(request: Request) -> None:
        if api_key is not None:
            check_bearer(request.headers.get("authorization"), api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(APIError(str(exc.detail), status=exc.status_code, code=None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return _error(APIError(f"internal server error: {exc!r}", status=500, type="server_error"))

    async def generate(request: Request, req: GenerationRequest) -> Response:
        base, subs = serving.prepare(req)
        group = await serving.submit(req, subs)
        if req.stream:
            return SSEResponse(serving.stream(req, base, subs, group), on_close=group.abort)
        task = asyncio.ensure_future(serving.complete(req, base, subs, group))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                group.abort()
        if task not in done:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(task.result())

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion_request(await read_json(request, max_request_bytes)))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat_request(await read_json(request, max_request_bytes)))

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "kvforge",
                "root": model_name, "max_model_len": serving.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return _error(APIError("the engine is not running", status=503, type="server_error", code="engine_unavailable"))

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics() -> PlainTextResponse:
        text = engine.metrics.render(engine.snapshot, model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
