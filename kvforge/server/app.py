"""FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Bodies are read and parsed by hand (size limit, JSON errors) so every failure
has an OpenAI-style error body. A client that goes away is noticed two ways:
a streaming response is cancelled by Starlette and its generator closed; a
non-streaming one races a disconnect watcher. Either way the request's group
is aborted, and the engine frees its blocks at the next step.

Nothing a client sends may turn into a 500 or a traceback in the log: bodies are read
under a deadline (408), checked for depth and lone UTF-16 surrogates (400 naming the
field), and a client that disconnects mid-upload costs one debug line. A real 500 says
"internal server error" and nothing more; the details go to the log only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvforge.server.async_engine import AsyncEngine
from kvforge.kv.salt import combine_salts
from kvforge.server.auth import check_bearer, split_api_keys
from kvforge.server.config import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from kvforge.server.guards import install_guards, tenant_salt
from kvforge.server.kv_map import add_kv_map_routes
from kvforge.server.metrics import CONTENT_TYPE
from kvforge.server.openapi import openapi_schema
from kvforge.server.protocol import APIError, GenerationRequest, parse_chat_request, parse_completion_request
from kvforge.server.request_group import ServerBusyError
from kvforge.server.serving import OpenAIServing
from kvforge.server.tokenizer_routes import add_tokenizer_routes

log = logging.getLogger("kvforge.server")
RETRY_AFTER_SECONDS = 1  # what a 503 for a full queue tells the client


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


def _error(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class ClientGone(Exception):
    """The client disconnected before its request body arrived: normal, logged at debug level."""


_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


async def read_json(request: Request, limit: int, timeout: float | None = None) -> Any:
    """The body as JSON, within `limit` bytes and `timeout` seconds (408), with OpenAI-style errors."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(f"the request body is {length} bytes; the limit is {limit}", status=413, code="request_too_large")
    body = bytearray()

    async def receive() -> None:
        async for part in request.stream():
            body.extend(part)
            if len(body) > limit:
                raise APIError(f"the request body exceeds the limit of {limit} bytes", status=413,
                               code="request_too_large")

    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout:g} s (--body-timeout)", status=408,
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError("the request body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(body):  # only a \uD800-\uDFFF escape can put a surrogate in a str
        where = _lone_surrogate(data)
        if where is not None:
            raise APIError(f"'{where}' contains a lone UTF-16 surrogate escape, which is not a character",
                           param=where)
    return data


def _lone_surrogate(data: Any) -> str | None:
    """Path of the first string (or key) that cannot be encoded as UTF-8, walking without recursion."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((f"{path}.{k}" if path else str(k), k))
                stack.append((f"{path}.{k}" if path else str(k), item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


class InternalErrors:
    """ASGI middleware: an unexpected exception becomes a generic 500 (details in the log, once), and the
    connection stays usable. Starlette's own `Exception` handler would re-raise it to uvicorn, which logs
    the traceback a second time and drops the keep-alive connection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: log it, answer 500
            log.error("internal error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            if scope["type"] != "http" or started:
                raise
            err = APIError("internal server error (details are in the server log)", status=500,
                           type="server_error", code="internal_error")
            await _error(err)(scope, receive, send)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: AsyncEngine, model_name: str, api_key: str | Sequence[str] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              body_timeout: float | None = DEFAULT_BODY_TIMEOUT, cache_salt_from_api_key: bool = False,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> FastAPI:
    """The ASGI app; `engine` must be started (and is shut down by the caller, not here).

    `api_key`: one key, or several ("k1,k2" or a list); every route but /health then needs one
    (kvforge/server/guards.py). `cache_salt_from_api_key`: each key is its own tenant's cache_salt."""
    api_keys = split_api_keys(api_key)
    if cache_salt_from_api_key and not api_keys:
        raise ValueError("cache_salt_from_api_key needs api_key (one key per tenant)")
    app = FastAPI(title="kvforge", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    serving = OpenAIServing(engine, model_name, tool_call_parser, reasoning_parser)
    app.state.engine, app.state.serving = engine, serving
    created = int(time.time())

    async def authorized(request: Request) -> None:  # RequireAPIKey guards every route already; kept per route
        if api_keys:
            check_bearer(request.headers.get("authorization"), api_keys)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(ServerBusyError)
    async def busy(_: Request, exc: ServerBusyError) -> JSONResponse:
        err = APIError(str(exc), status=503, type="server_error", code="server_busy")
        return _error(err, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, _: ClientGone) -> Response:
        log.debug("client %s disconnected before its request body arrived", request.client)
        return Response(status_code=499)  # nobody reads this

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(APIError(str(exc.detail), status=exc.status_code, code=None))

    app.add_middleware(InternalErrors)
    install_guards(app, api_keys, cache_salt_from_api_key)

    async def generate(request: Request, req: GenerationRequest) -> Response:
        req.cache_salt = combine_salts(tenant_salt(request), req.cache_salt)
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

    async def body(request: Request) -> Any:
        return await read_json(request, max_request_bytes, body_timeout)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion_request(await body(request)))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat_request(await body(request)))

    def model_card() -> dict:
        report = engine.engine.report
        return {"id": model_name, "object": "model", "created": created, "owned_by": "kvforge",
                "root": model_name, "max_model_len": serving.max_model_len,
                "kvforge": {  # the ledger: what the KV cache really holds, next to the configured limit
                    "configured_max_model_len": serving.limits.max_model_len,
                    "kv_cache_tokens": report.token_capacity, "kv_cache_blocks": report.num_blocks,
                    "block_size": report.block_size, "kv_cache_bytes": report.kv_cache_bytes,
                    "kv_cache_dtype": report.kv_dtype, "max_num_seqs": report.max_num_seqs}}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def retrieve_model(model_id: str) -> dict:  # the openai SDK's models.retrieve
        if model_id != model_name:
            raise APIError(f"The model '{model_id}' does not exist", status=404, param="model",
                           code="model_not_found")
        return model_card()

    add_tokenizer_routes(app, serving, body, [Depends(authorized)])  # /tokenize, /detokenize, /tokenizer_info

    @app.get("/health")
    async def health() -> Response:
        if engine.draining:
            return _error(APIError("the server is shutting down", status=503, type="server_error",
                                   code="draining"))
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return _error(APIError("the engine is not running", status=503, type="server_error", code="engine_unavailable"))

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(engine.snapshot, model_name), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(openapi_schema(bool(api_keys)))

    add_kv_map_routes(app, engine, api_keys or None)  # /kv, /kv/state, /kv/stream: the live KV block map
    return app
