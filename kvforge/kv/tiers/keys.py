"""Tier keys: the block hash chain inside a namespace. Pure Python.

The block hash already covers the whole prefix and the request's cache_salt
(kvforge.kv.hashing puts it in the first block's hash). The namespace adds what
the hash cannot know: which model wrote the KV (a weights fingerprint), in which
format (K/V dtypes, scale granularity and static scales), with which block size
and per-layer tensor layout. Two engines share tier entries only when all match.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

FORMAT_VERSION = 1


def namespace_digest(parts: dict[str, Any]) -> bytes:
    """A stable 32-byte digest of the namespace description (JSON with sorted keys)."""
    blob = json.dumps({"version": FORMAT_VERSION, **parts}, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).digest()


def tier_key(namespace: bytes, block_hash: bytes) -> bytes:
    """The content address of one block in one namespace."""
    return hashlib.sha256(namespace + block_hash).digest()
