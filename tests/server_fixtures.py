"""Shared helpers for the server tests: a tiny model served on a free loopback port."""
from __future__ import annotations

import asyncio
import time

from kvforge.engine.args import EngineArgs
from kvforge.engine.engine import LLMEngine
from kvforge.server.background import BackgroundServer
from tiny_models import build_tiny_model

MODEL_NAME = "tiny"


def tiny_model_dir(tmp_path_factory, family: str = "llama_gqa") -> str:  # type: ignore[no-untyped-def]
    path = str(tmp_path_factory.mktemp("tiny-" + family))
    build_tiny_model(path, family)
    return path


def start_server(model_dir: str, api_key: str | None = None, app_kwargs: dict | None = None,
                 **engine_kwargs: object) -> BackgroundServer:
    kwargs: dict = dict(num_kv_blocks=256, max_model_len=256, max_num_seqs=64, log_ledger=False)
    kwargs.update(engine_kwargs)
    engine = LLMEngine(EngineArgs(model=model_dir, **kwargs))
    return BackgroundServer(engine, model_name=MODEL_NAME, api_key=api_key, max_request_bytes=64 * 1024,
                            **(app_kwargs or {})).start()


def on_engine(srv: BackgroundServer, fn):  # type: ignore[no-untyped-def]
    """Run fn(engine) on the engine thread (the only thread allowed to touch it)."""
    return asyncio.run(srv.async_engine.call(fn))


def wait_idle_and_check_blocks(srv: BackgroundServer, timeout: float = 20.0) -> None:
    """Every request finished or aborted, every block free, pool invariants hold."""
    deadline = time.monotonic() + timeout
    while on_engine(srv, lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "engine still has unfinished requests"
        time.sleep(0.02)

    def check(e: LLMEngine) -> tuple[int, int]:
        e.check_integrity()
        return e.pool.num_free_blocks, e.pool.num_blocks

    free, total = on_engine(srv, check)
    assert free == total, f"{total - free} KV blocks leaked"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, parsed by prometheus-client's own parser (so a malformed
    exposition fails the test); labels in the key: model_name first, then the others in written order."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            items = sorted(s.labels.items(), key=lambda kv: kv[0] != "model_name")
            labels = ",".join(f'{k}="{v}"' for k, v in items)
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for_health(proc, url: str, timeout: float) -> None:
    """Poll a `kvforge serve` subprocess's /health until 200; fail with its output if it exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)
