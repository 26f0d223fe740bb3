"""The API fuzzed by schemathesis from the server's own /openapi.json (issue 13).

Invariants, for schema-valid (positive) and schema-violating (negative) bodies alike:
no 5xx; every 4xx is an OpenAI-style error object carrying `param` (named when the body
was a JSON object); /health stays 200 after every case; the KV pool ends all-free.
The example count is bounded (KVFORGE_FUZZ_EXAMPLES, default 20 per operation and mode)
and derandomized, so the suite stays fast and repeatable.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from kvforge import envs
from server_fixtures import start_server, tiny_model_dir, wait_idle_and_check_blocks

pytestmark = pytest.mark.slow  # schemathesis over every operation

EXAMPLES = envs.KVFORGE_FUZZ_EXAMPLES
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# (path, method, mode); a GET without parameters has no negative form
CASES = [("/v1/completions", "POST", POSITIVE), ("/v1/completions", "POST", NEGATIVE),
         ("/v1/chat/completions", "POST", POSITIVE), ("/v1/chat/completions", "POST", NEGATIVE),
         ("/v1/models", "GET", POSITIVE)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # short contexts bound each generation; few sequence slots make large n a 400, not a long wait
    srv = start_server(tiny_model_dir(tmp_path_factory), num_kv_blocks=64, max_model_len=48, max_num_seqs=4)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def schema(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(spec)


def _check(server, case, response) -> None:  # type: ignore[no-untyped-def]
    status = response.status_code
    assert status < 500, f"{case.method} {case.path} {case.body!r} -> {status} {response.text[:300]}"
    if status >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        if status == 400 and isinstance(case.body, dict) and "not valid JSON" not in err["message"]:
            assert err["param"], f"400 without param for {case.body!r}: {err}"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path,method,mode", CASES, ids=[f"{p}-{m.value}" for p, _, m in CASES])
def test_fuzzed_requests_never_hurt_the_server(server, schema, path, method, mode):
    strategy = schema[path][method].as_strategy(generation_mode=mode)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):  # type: ignore[no-untyped-def]
        response = case.call(base_url=server.url, timeout=60)
        _check(server, case, response)

    run()
    wait_idle_and_check_blocks(server)
