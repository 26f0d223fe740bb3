"""cache_salt: the tenant key that enters the first block's hash, so two salts never share a KV block.

Pure Python. A salt is checked once here, for the Python API (`LLM.generate`,
`LLMEngine.add_request`) and the server alike, so a 1 MB string, an object or an
empty string is refused with the same message instead of being hashed silently.
The hash chain carries the salt to every later block, and tier keys are built from
block hashes, so the host and disk tiers isolate tenants without knowing salts.

`salt_for_api_key` is how a server with one API key per tenant salts every request
by its key: a digest, so the key itself never sits in a hash input, a log or a file.
"""
from __future__ import annotations

import hashlib
from typing import Any

MAX_CACHE_SALT_CHARS = 256  # long enough for any tenant id or digest; a bound keeps hashing and logs cheap


def check_cache_salt(value: Any, name: str = "cache_salt") -> str | None:
    """`value` if it is a valid salt (None: no salt); ValueError naming `name` otherwise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string (omit it for no salt)")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"{name} may be at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be valid Unicode text (it holds a lone surrogate)") from None
    return value


def salt_for_api_key(api_key: str) -> str:
    """The salt a request authenticated by `api_key` gets (`--cache-salt-from-api-key`)."""
    return "key:" + hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:32]


def combine_salts(tenant: str | None, client: str | None) -> str | None:
    """The salt of a request: the server's tenant salt, refined by the client's own (never replaced by it)."""
    if tenant is None or client is None:
        return tenant if client is None else client
    # a digest keeps the pair within MAX_CACHE_SALT_CHARS and can equal no plain tenant salt
    return "pair:" + hashlib.sha256(f"{tenant}\x00{client}".encode("utf-8")).hexdigest()[:40]
