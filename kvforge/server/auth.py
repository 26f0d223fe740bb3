"""Bearer-token check for `--api-key` / KVFORGE_API_KEY (every endpoint but /health).

`--api-key` may list several keys separated by commas (one per tenant); a request
names its tenant by the key it sends, which `--cache-salt-from-api-key` turns into
its cache_salt (kvforge/kv/salt.py).
"""
from __future__ import annotations

import hmac
from collections.abc import Sequence

from kvforge import envs
from kvforge.server.protocol import APIError

def resolve_api_key(cli_value: str | None) -> str | None:
    """The flag wins over the environment; an empty string means no key."""
    key = cli_value if cli_value is not None else envs.KVFORGE_API_KEY
    return key or None


def split_api_keys(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """`"k1,k2"` (or a list of keys) -> ("k1", "k2"); empty entries are dropped, None -> no keys."""
    if value is None:
        return ()
    parts = value.split(",") if isinstance(value, str) else list(value)
    return tuple(dict.fromkeys(p.strip() for p in parts if p.strip()))


def check_bearer(authorization: str | None, api_keys: str | Sequence[str]) -> str:
    """The key the header `Bearer <key>` carries, if it is one of `api_keys`; a 401 APIError otherwise.

    Every key is compared in constant time, so timing shows neither which key nor how much of one matched.
    """
    keys = (api_keys,) if isinstance(api_keys, str) else tuple(api_keys)
    scheme, _, token = (authorization or "").partition(" ")
    sent = token.strip().encode()
    matched = None
    for key in keys:
        if hmac.compare_digest(sent, key.encode()) and matched is None:
            matched = key
    if scheme.lower() != "bearer" or matched is None:
        raise APIError(
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            status=401, code="invalid_api_key",
        )
    return matched
