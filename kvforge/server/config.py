"""ServerConfig: the HTTP server's own options, each declared once; `kvforge serve` generates its flags from them.

A new server option is one `option(...)` field here (validated in `__post_init__`,
naming the field; the CLI renames it to the flag). Torch-free, so `kvforge --help`
stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.flags import option

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on every endpoint but /health (or set KVFORGE_API_KEY)")
    served_model_name: str | None = option(None, "model id clients send (default: the model's name)")
    max_request_bytes: int = option(DEFAULT_MAX_REQUEST_BYTES, "larger request bodies get HTTP 413")
    log_level: str = option("info", "server log level", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
