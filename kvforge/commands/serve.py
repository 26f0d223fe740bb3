"""`kvforge serve`: the OpenAI-compatible server on --host:--port with the engine flags of `LLM`.

Server flags come from `kvforge.server.config.ServerConfig`, engine flags from
`kvforge.engine.args.EngineConfig`: a new option is one field there.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from kvforge.engine.args import EngineConfig, add_engine_cli_args, engine_args_from_cli
from kvforge.flags import add_dataclass_flags, flag_errors, flags_of, values_for
from kvforge.server.config import ServerConfig

HELP = "OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_dataclass_flags(p.add_argument_group("server"), ServerConfig)
    add_engine_cli_args(p)


def served_model_name(model: str | None) -> str:
    from kvforge.models.loader import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def server_config_from_cli(args: argparse.Namespace) -> ServerConfig:
    with flag_errors(flags_of(ServerConfig)):
        return ServerConfig(**values_for(ServerConfig, args))


def run(args: argparse.Namespace) -> int:
    from kvforge.engine.engine import LLMEngine
    from kvforge.server.app import build_app
    from kvforge.server.async_engine import AsyncEngine
    from kvforge.server.auth import resolve_api_key
    from kvforge.server.lifecycle import DrainingServer, ServerLimits, uvicorn_config

    server = server_config_from_cli(args)
    if server.cache_salt_from_api_key and not resolve_api_key(server.api_key):
        raise ValueError("--cache-salt-from-api-key needs --api-key (or KVFORGE_API_KEY): one key per tenant")
    engine_config = engine_args_from_cli(args)  # validates the engine flags before the slow model load
    if server.replicas is not None:
        return _run_replicas(server, engine_config)
    logging.basicConfig(level=server.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    name = server.served_model_name or served_model_name(engine_config.model_options.model)
    limits = ServerLimits(server.header_timeout, server.keep_alive_timeout, server.max_connections,
                          server.shutdown_timeout)
    engine = AsyncEngine(LLMEngine(engine_config), max_waiting_requests=server.max_waiting_requests).start()
    app = build_app(engine, name, api_key=resolve_api_key(server.api_key), max_request_bytes=server.max_request_bytes,
                    body_timeout=server.body_timeout, cache_salt_from_api_key=server.cache_salt_from_api_key,
                    tool_call_parser=server.tool_call_parser, reasoning_parser=server.reasoning_parser)
    uv = DrainingServer(uvicorn_config(app, limits, host=server.host, port=server.port, log_level=server.log_level),
                        engine, limits.shutdown_timeout)
    print(f"kvforge serve: '{name}' on http://{server.host}:{server.port}/v1", flush=True)
    try:
        uv.run()
    finally:
        engine.shutdown()
    if uv.fatal is not None:
        print(f"kvforge serve: error: the engine cannot continue ({type(uv.fatal).__name__}); exiting so a "
              "supervisor can restart the server (details above)", file=sys.stderr, flush=True)
        return 1
    return 0


def _run_replicas(server: ServerConfig, engine_config: EngineConfig) -> int:
    """`--replicas N`: the same OpenAI API on Ray Serve (kvforge/distributed/ray_serve.py)."""
    from kvforge.server.auth import resolve_api_key

    if resolve_api_key(server.api_key):
        raise ValueError("--api-key is not supported with --replicas yet; put the Ray Serve proxy behind your gateway")
    if server.tool_call_parser or server.reasoning_parser:
        raise ValueError("--tool-call-parser and --reasoning-parser are not supported with --replicas yet")
    try:
        from kvforge.distributed.ray_serve import run_replicas
    except ImportError as exc:
        raise ValueError(f"--replicas needs Ray Serve: pip install 'kvforge[ray]' ({exc})") from None
    engine = {k: v for k, v in engine_config.to_dict().items() if k != "log_ledger"}
    name = server.served_model_name or served_model_name(engine_config.model_options.model)
    return run_replicas(server, engine, name)
