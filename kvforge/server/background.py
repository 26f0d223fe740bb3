"""Run the server inside the current process on a background thread (tests, notebooks, benchmarks).

Binds its own socket first, so port 0 picks a free port that is known before
the first request.
"""
from __future__ import annotations

import socket
import threading
import time


from kvforge.engine.engine import LLMEngine
from kvforge.server.app import build_app
from kvforge.server.async_engine import AsyncEngine
from kvforge.server.lifecycle import DrainingServer, ServerLimits, uvicorn_config


class BackgroundServer:
    """`with BackgroundServer(engine) as srv: srv.url` -> 'http://127.0.0.1:PORT'."""

    def __init__(self, engine: LLMEngine, model_name: str = "kvforge-model", api_key: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, limits: ServerLimits | None = None,
                 max_waiting_requests: int | None = None, **app_kwargs: object) -> None:
        limits = limits or ServerLimits()
        self.async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
        self.app = build_app(self.async_engine, model_name, api_key=api_key, **app_kwargs)  # type: ignore[arg-type]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn_config(self.app, limits, log_level="warning", lifespan="off")
        self.server = DrainingServer(config, self.async_engine, limits.shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="kvforge-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.async_engine.start()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def drain(self) -> None:
        """What SIGTERM does to `kvforge serve`: stop admitting, finish or end running requests, then stop."""
        self.server.request_drain()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.async_engine.shutdown()
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
