"""ASGI guards in front of every route: the API key, and JSON-only request bodies.

They wrap the whole app rather than decorating routes, so a route added later is
guarded by default; only the paths in `OPEN_PATHS` answer without a key (a load
balancer's health probe carries none). `tests/test_trust_server.py` walks the route
table to keep it so.

JSON only: a POST must say `Content-Type: application/json`. A browser sends a
cross-site `text/plain` or form POST without a CORS preflight, so accepting those
would let any web page drive a local server that has no `--api-key`; a JSON POST
needs the preflight, which this server never grants. A compressed body
(`Content-Encoding` other than identity) is refused as well, with 415 naming the
header, instead of failing later as undecodable JSON.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from kvforge.kv.salt import salt_for_api_key
from kvforge.server.auth import check_bearer
from kvforge.server.kv_map import COOKIE as KEY_COOKIE
from kvforge.server.protocol import APIError

OPEN_PATHS = frozenset({"/health"})
# A browser page cannot send an Authorization header on navigation: the KV map page (/kv, kv_map.py) logs
# in once with `?key=` and then carries the key in an HttpOnly cookie; both are accepted as the key.
KEY_QUERY_PATHS = frozenset({"/kv"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
TENANT_SALT = "tenant_salt"  # request.state key: the salt --cache-salt-from-api-key derived, or absent


async def _send_error(send: Send, exc: APIError, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(exc.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class RequireAPIKey:
    """401 on every path but `OPEN_PATHS` unless `Authorization: Bearer <one of api_keys>`.

    With `salt_from_key`, the matched key's salt is left in `request.state.tenant_salt`.
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], salt_from_key: bool = False) -> None:
        self.app, self.api_keys, self.salt_from_key = app, tuple(api_keys), salt_from_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            key = check_bearer(_credential(scope), self.api_keys)
        except APIError as exc:
            await _send_error(send, exc, {"WWW-Authenticate": "Bearer"})
            return
        if self.salt_from_key:
            scope.setdefault("state", {})[TENANT_SALT] = salt_for_api_key(key)
        await self.app(scope, receive, send)


def _credential(scope: Scope) -> str | None:
    """`Bearer <key>` from the Authorization header, else from the key cookie or (page login) `?key=`."""
    header = _header(scope, b"authorization")
    if header:
        return header
    from http.cookies import SimpleCookie
    from urllib.parse import parse_qs

    cookie = SimpleCookie()
    try:
        cookie.load(_header(scope, b"cookie") or "")
    except Exception:  # noqa: BLE001 - a malformed Cookie header is no credential
        cookie = SimpleCookie()
    if KEY_COOKIE in cookie:
        return f"Bearer {cookie[KEY_COOKIE].value}"
    if scope.get("path") in KEY_QUERY_PATHS:
        keys = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key")
        if keys:
            return f"Bearer {keys[0]}"
    return None


class RequireJSONBody:
    """415 for a body-carrying request that is not `application/json`, or that is compressed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in BODY_METHODS:
            problem = body_problem(_header(scope, b"content-type"), _header(scope, b"content-encoding"))
            if problem is not None:
                await _send_error(send, problem)
                return
        await self.app(scope, receive, send)


def body_problem(content_type: str | None, content_encoding: str | None) -> APIError | None:
    """The 415 a body with these headers gets, or None when it is plain JSON."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        shown = f"'{content_type}'" if content_type else "missing"
        return APIError(f"the Content-Type header must be 'application/json', got {shown}", status=415,
                        param="Content-Type", code="unsupported_media_type")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding not in ("", "identity"):
        return APIError(f"the Content-Encoding header must be 'identity' (send the body uncompressed), "
                        f"got '{content_encoding}'", status=415, param="Content-Encoding",
                        code="unsupported_media_type")
    return None


def install_guards(app: Any, api_keys: Sequence[str], salt_from_key: bool = False) -> None:
    """Wrap `app`: the key check runs first (401 before 415), then the body check."""
    app.add_middleware(RequireJSONBody)
    if api_keys:
        app.add_middleware(RequireAPIKey, api_keys=api_keys, salt_from_key=salt_from_key)


def tenant_salt(request: Any) -> str | None:
    """The salt the key check derived for this request (None without --cache-salt-from-api-key)."""
    return getattr(request.state, TENANT_SALT, None)
