"""`kvforge serve`: the OpenAI-compatible server on --host:--port with the engine flags of `LLM`."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from kvforge.server.app import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES


def add_parser(sub: argparse._SubParsersAction) -> None:
    from kvforge.engine.args import add_engine_cli_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)",
                       description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (or set KVFORGE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger bodies get HTTP 413 (default 4 MiB)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_reliability_args(p)
    add_engine_cli_args(p)
    p.set_defaults(func=run)


def add_reliability_args(p: argparse.ArgumentParser) -> None:
    """Timeouts, backpressure and drain (README: "Running in production"); kept apart for easy merging."""
    g = p.add_argument_group("reliability")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="past this many queued requests, answer 503 with Retry-After (default: unbounded, as vLLM; "
                        "set it to about max_num_seqs x the queue time you accept / the mean request time)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish before their streams are ended with an "
                        "error event and [DONE] (default 30)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a complete request head (default 10)")
    g.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help="seconds a request body has to arrive, else HTTP 408 (default 30)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="idle seconds before a keep-alive connection is closed (default 5)")
    g.add_argument("--max-connections", type=int, default=None,
                   help="concurrent connections before new ones get 503 (default: unbounded)")


def served_model_name(model: str | None) -> str:
    from kvforge.models.loader import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def run(args: argparse.Namespace) -> int:
    from kvforge.engine.args import engine_args_from_cli
    from kvforge.engine.engine import LLMEngine
    from kvforge.server.app import build_app
    from kvforge.server.async_engine import AsyncEngine
    from kvforge.server.auth import resolve_api_key
    from kvforge.server.lifecycle import DrainingServer, ServerLimits, uvicorn_config

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be >= 1024, got {args.max_request_bytes}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if not args.body_timeout > 0:
        raise ValueError(f"--body-timeout must be > 0 seconds, got {args.body_timeout}")
    limits = ServerLimits(args.header_timeout, args.keep_alive_timeout, args.max_connections, args.shutdown_timeout)
    engine_args = engine_args_from_cli(args)  # validates the engine flags before the slow model load
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or served_model_name(args.model)
    engine = AsyncEngine(LLMEngine(engine_args), max_waiting_requests=args.max_waiting_requests).start()
    app = build_app(engine, name, api_key=resolve_api_key(args.api_key), max_request_bytes=args.max_request_bytes,
                    body_timeout=args.body_timeout)
    server = DrainingServer(uvicorn_config(app, limits, host=args.host, port=args.port, log_level=args.log_level),
                            engine, limits.shutdown_timeout)
    print(f"kvforge serve: '{name}' on http://{args.host}:{args.port}/v1", flush=True)
    try:
        server.run()
    finally:
        engine.shutdown()
    if server.fatal is not None:
        print(f"kvforge serve: error: the engine cannot continue ({type(server.fatal).__name__}); exiting so a "
              "supervisor can restart the server (details above)", file=sys.stderr, flush=True)
        return 1
    return 0
