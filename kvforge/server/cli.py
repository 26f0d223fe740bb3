"""`kvforge serve`: the OpenAI-compatible server on --host:--port with the engine flags of `LLM`."""
from __future__ import annotations

import argparse
import logging
import os

from kvforge.server.app import DEFAULT_MAX_REQUEST_BYTES


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
    p.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas on Ray Serve, routed by their KV caches (needs kvforge[ray])")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: Ray cluster to join ('auto' = the running one); default: a local Ray on loopback")
    add_engine_cli_args(p)
    p.set_defaults(func=run)


def served_model_name(model: str | None) -> str:
    from kvforge.models.loader import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvforge.engine.args import engine_args_from_cli
    from kvforge.engine.engine import LLMEngine
    from kvforge.server.app import build_app
    from kvforge.server.async_engine import AsyncEngine
    from kvforge.server.auth import resolve_api_key

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be >= 1024, got {args.max_request_bytes}")
    engine_args = engine_args_from_cli(args)  # validates the engine flags before the slow model load
    if args.replicas is not None or args.ray_address is not None:
        return _run_replicas(args, engine_args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or served_model_name(args.model)
    engine = AsyncEngine(LLMEngine(engine_args)).start()
    app = build_app(engine, name, api_key=resolve_api_key(args.api_key), max_request_bytes=args.max_request_bytes)
    print(f"kvforge serve: '{name}' on http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0


def _run_replicas(args: argparse.Namespace, engine_args: object) -> int:
    """`--replicas N`: the same OpenAI API on Ray Serve (kvforge/distributed/ray_serve.py)."""
    if args.replicas is None or args.replicas < 1:
        raise ValueError(f"--replicas must be a positive integer (required with --ray-address), got {args.replicas}")
    if args.api_key or os.environ.get("KVFORGE_API_KEY"):
        raise ValueError("--api-key is not supported with --replicas yet; put the Ray Serve proxy behind your gateway")
    try:
        from kvforge.distributed.ray_serve import run_replicas
    except ImportError as exc:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'kvforge[ray]' ({exc})") from None
    engine = {k: v for k, v in engine_args.to_dict().items() if k != "log_ledger"}  # type: ignore[attr-defined]
    return run_replicas(args, engine, args.served_model_name or served_model_name(args.model))
