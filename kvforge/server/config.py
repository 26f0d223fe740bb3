"""ServerConfig: the HTTP server's own options, each declared once; `kvforge serve` generates its flags from them.

A new server option is one `option(...)` field here (validated in `__post_init__`,
naming the field; the CLI renames it to the flag). Torch-free, so `kvforge --help`
stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.flags import option

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a whole request body to arrive
LOG_LEVELS = ("debug", "info", "warning", "error")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")  # kvforge/server/tool_parsers.py
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # kvforge/server/reasoning.py


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on every endpoint but /health (or set KVFORGE_API_KEY); "
        "several keys: KEY1,KEY2")
    cache_salt_from_api_key: bool = option(
        False, "one API key per tenant: each request's cache_salt is derived from the key it sent, so tenants "
        "never share KV blocks (device, host or disk); a client's own cache_salt refines it")
    served_model_name: str | None = option(None, "model id clients send (default: the model's name)")
    max_request_bytes: int = option(DEFAULT_MAX_REQUEST_BYTES, "larger request bodies get HTTP 413")
    log_level: str = option("info", "server log level", choices=LOG_LEVELS)
    tool_call_parser: str | None = option(
        None, "how tool calls are read from replies with tool_choice 'auto' (default: the chat template's own format "
        "when kvforge knows it; templates without tools get kvforge's constrained JSON format)",
        choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = option(
        None, "move <think>...</think> out of the content into reasoning_content", choices=REASONING_PARSERS)
    # reliability (docs/serving.md: "Running in production"): timeouts, backpressure, drain
    max_waiting_requests: int | None = option(
        None, "past this many queued requests, answer 503 with Retry-After (default: unbounded, as vLLM; set it to "
        "about max_num_seqs x the queue time you accept / the mean request time)")
    shutdown_timeout: float = option(
        30.0, "on SIGTERM, seconds running requests get to finish before their streams are ended with an error "
        "event and [DONE]")
    header_timeout: float = option(10.0, "seconds a connection has to send a complete request head")
    body_timeout: float = option(DEFAULT_BODY_TIMEOUT, "seconds a request body has to arrive, else HTTP 408")
    keep_alive_timeout: float = option(5.0, "idle seconds before a keep-alive connection is closed")
    max_connections: int | None = option(None, "concurrent connections before new ones get 503 (default: unbounded)")
    # Ray Serve (kvforge/distributed/ray_serve.py, needs kvforge[ray])
    replicas: int | None = option(
        None, "serve N engine replicas on Ray Serve, routed by their KV caches (needs kvforge[ray])")
    ray_address: str | None = option(
        None, "with --replicas: Ray cluster to join ('auto' = the running one); default: a local Ray on loopback")

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        for name in ("shutdown_timeout", "header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.replicas is not None and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ValueError(f"replicas must be a positive integer, got {self.replicas}")
        if self.ray_address is not None and self.replicas is None:
            raise ValueError("replicas is required with ray_address")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
