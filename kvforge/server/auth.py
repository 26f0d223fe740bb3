"""Bearer-token check for `--api-key` / KVFORGE_API_KEY (every endpoint but /health)."""
from __future__ import annotations

import hmac

from kvforge import envs
from kvforge.server.protocol import APIError

def resolve_api_key(cli_value: str | None) -> str | None:
    """The flag wins over the environment; an empty string means no key."""
    key = cli_value if cli_value is not None else envs.KVFORGE_API_KEY
    return key or None


def check_bearer(authorization: str | None, api_key: str) -> None:
    """Raise a 401 APIError unless the header is `Bearer <api_key>` (compared in constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            status=401, code="invalid_api_key",
        )
