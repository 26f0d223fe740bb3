"""The server's trust boundary: every route behind the key, JSON-only bodies, cache_salt validated and isolating.

The auth test walks the app's route table, so a route added later without the guard
fails here. The 415 cases run on a server without a key too: that is the one a web page
could reach through a visitor's browser with a `text/plain` POST (no CORS preflight).
"""
from __future__ import annotations

import json

import httpx
import pytest
from starlette.routing import Route

from server_fixtures import MODEL_NAME, start_server, tiny_model_dir, wait_idle_and_check_blocks
from kvforge.kv.salt import MAX_CACHE_SALT_CHARS
from kvforge.server.guards import OPEN_PATHS

KEYS = ("key-tenant-a", "key-tenant-b")
PROMPT = [(7 * i + 3) % 250 for i in range(41)]  # token ids: 10 full blocks of 4 and the token computed anyway
BODY = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def keyed(model_dir):
    srv = start_server(model_dir, api_key=",".join(KEYS), app_kwargs={"cache_salt_from_api_key": True}, block_size=4)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server(model_dir):
    srv = start_server(model_dir, block_size=4)
    yield srv
    srv.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _ask(http: httpx.Client, method: str, path: str, **kwargs) -> tuple[int, httpx.Headers, bytes]:
    """Status, headers and body; an event stream (e.g. /kv/stream, endless) is closed unread."""
    with http.stream(method, path, **kwargs) as r:
        endless = r.headers.get("content-type", "").startswith("text/event-stream")
        return r.status_code, r.headers, b"" if endless else r.read()


def test_every_route_but_health_needs_the_key(keyed):
    routes = [r for r in keyed.app.routes if isinstance(r, Route)]
    paths = {r.path for r in routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/openapi.json", "/health"} <= paths
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        for route in routes:
            path = route.path.replace("{", "").replace("}", "")  # a path parameter gets its own name as value
            for method in sorted(route.methods or {"GET"}):
                if method == "HEAD":
                    continue
                kwargs = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
                status, headers, body = _ask(http, method, path, **kwargs)
                if route.path in OPEN_PATHS:
                    assert status != 401, (method, path)
                    continue
                assert status == 401, (method, path, status)
                assert json.loads(body)["error"]["code"] == "invalid_api_key"
                assert headers["www-authenticate"] == "Bearer"
                assert _ask(http, method, path, headers=_auth("wrong"), **kwargs)[0] == 401
                for key in KEYS:  # every key of the list is accepted
                    assert _ask(http, method, path, headers=_auth(key), **kwargs)[0] != 401, (method, path)
        assert http.get("/not-a-route").status_code == 401  # unknown paths do not reveal what exists
        assert http.get("/openapi.json", headers=_auth(KEYS[0])).status_code == 200


@pytest.mark.parametrize("headers, param", [
    ({"content-type": "text/plain"}, "Content-Type"),
    ({"content-type": "application/x-www-form-urlencoded"}, "Content-Type"),
    ({"content-type": "multipart/form-data; boundary=x"}, "Content-Type"),
    ({}, "Content-Type"),
    ({"content-type": "application/json", "content-encoding": "gzip"}, "Content-Encoding"),
    ({"content-type": "application/json", "content-encoding": "br"}, "Content-Encoding"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_json_bodies_get_415_naming_the_header(open_server, path, headers, param):
    raw = json.dumps(BODY).encode()
    r = httpx.post(open_server.url + path, content=raw, headers=headers, timeout=60)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["code"] == "unsupported_media_type"


def test_json_with_charset_and_identity_encoding_is_accepted(open_server):
    r = httpx.post(open_server.url + "/v1/completions", content=json.dumps(BODY).encode(), timeout=60,
                   headers={"content-type": "Application/JSON; charset=utf-8", "content-encoding": "identity"})
    assert r.status_code == 200, r.text


def test_a_key_is_checked_before_the_content_type(keyed):
    r = httpx.post(keyed.url + "/v1/completions", content=b"{}", headers={"content-type": "text/plain"}, timeout=60)
    assert r.status_code == 401


@pytest.mark.parametrize("salt, words", [
    ("", "non-empty"), ({"a": 1}, "string"), (["a"], "string"), (7, "string"), (True, "string"),
    ("x" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS}"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_cache_salt_is_400_naming_it(open_server, path, salt, words):
    body = {**BODY, "cache_salt": salt}
    if "chat" in path:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt}
    r = httpx.post(open_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and words in err["message"]


def test_cache_salt_isolates_requests_on_both_routes(open_server):
    url = open_server.url
    with httpx.Client(base_url=url, timeout=60) as http:
        salted = [(i * 13 + 1) % 250 for i in range(41)]
        assert _cached(http.post("/v1/completions", json={**BODY, "prompt": salted, "cache_salt": "A"})) == 0
        assert _cached(http.post("/v1/completions", json={**BODY, "prompt": salted, "cache_salt": "B"})) == 0
        assert _cached(http.post("/v1/completions", json={**BODY, "prompt": salted})) == 0
        assert _cached(http.post("/v1/completions", json={**BODY, "prompt": salted, "cache_salt": "A"})) == 40
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "tenant " * 30}], "max_tokens": 2}
        assert _cached(http.post("/v1/chat/completions", json={**chat, "cache_salt": "A"})) == 0
        assert _cached(http.post("/v1/chat/completions", json={**chat, "cache_salt": "B"})) == 0
        assert _cached(http.post("/v1/chat/completions", json={**chat, "cache_salt": "A"})) > 0
    wait_idle_and_check_blocks(open_server)


def test_cache_salt_from_api_key_isolates_tenants(keyed):
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        a, b = _auth(KEYS[0]), _auth(KEYS[1])
        assert _cached(http.post("/v1/completions", json=BODY, headers=a)) == 0
        assert _cached(http.post("/v1/completions", json=BODY, headers=b)) == 0  # another key: another tenant
        assert _cached(http.post("/v1/completions", json=BODY, headers=a)) == 40  # same key: shared
        # a client salt refines its tenant's salt, it never reaches another tenant's blocks
        assert _cached(http.post("/v1/completions", json={**BODY, "cache_salt": "x"}, headers=b)) == 0
        assert _cached(http.post("/v1/completions", json={**BODY, "cache_salt": "x"}, headers=a)) == 0
        assert _cached(http.post("/v1/completions", json={**BODY, "cache_salt": "x"}, headers=b)) == 40
    wait_idle_and_check_blocks(keyed)


def test_drain_rejects_new_requests_with_the_code_health_shows(open_server):
    engine = open_server.async_engine
    engine.draining = True
    try:
        health = httpx.get(open_server.url + "/health", timeout=30)
        r = httpx.post(open_server.url + "/v1/completions", json=BODY, timeout=30)
    finally:
        engine.draining = False
    assert health.status_code == r.status_code == 503
    assert r.json()["error"]["code"] == health.json()["error"]["code"] == "draining"


@pytest.mark.parametrize("n", [65, 128, 129, 10**6])
def test_one_message_for_the_n_limit(open_server, n):
    r = httpx.post(open_server.url + "/v1/completions", json={**BODY, "n": n}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["message"] == f"n must be an integer in [1, max_num_seqs=64], got {n}"
