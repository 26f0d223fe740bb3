"""Block hash chain for prefix caching.

A full block's hash covers its parent's hash, its token ids and extra keys
(cache salt, adapter), so equal hashes mean equal prefixes up to and including
the block. SHA-256 over a canonical byte encoding keeps hashes stable across
processes (Python's `hash()` is randomised per process), which a host tier or
another process needs in order to share blocks.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"kvforge-root-v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        encoded = key.encode("utf-8")
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str] = ()
) -> list[BlockHash]:
    """Append hashes for every full block of `token_ids` not hashed yet.

    Extra keys enter the first block only: the chain carries them to every later block.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(parent, block, extra_keys if i == 0 else ()))
    return hashes
