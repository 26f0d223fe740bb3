"""Zeroed KV pool tensors whose memory is committed as blocks are written, not when the pool is made.

Why: the pool is sized up front (`kv_cache_memory`, `num_kv_blocks`) so admission and the ledger can count
blocks, but `torch.zeros` writes every byte at start-up, so a 2 GiB pool is 2 GiB of RSS before the first
request, however little of it a workload ever holds. On CPU the pool's tensors are views of an anonymous
`mmap`: the kernel hands out zero-filled pages on first write (reads of an untouched page see the shared
zero page), so the process's RSS grows with the blocks actually written, as OpenVINO's cache and
llama.cpp's lazily touched buffers do. The values are those of `torch.zeros`; kernels that read a whole
block past a sequence's end still read zeros. Elsewhere (CUDA) it is `torch.zeros`: device memory has no
such lazy commit, and vLLM-style up-front reservation is what a GPU server expects.

What a reserved pool can not do is promise the memory: with overcommit a host that runs out while blocks
are first written kills the process, where `torch.zeros` would have failed at start-up. The ledger states
the pool's reserved bytes; RSS after a run shows what was committed.
"""
from __future__ import annotations

import math
import mmap

import torch

# Below this a pool tensor (scales, tiny test pools) is not worth a mapping of its own.
_MIN_LAZY_BYTES = 1 << 20


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor of `shape`: on CPU backed by zero-on-first-write anonymous memory (see the module doc)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < _MIN_LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes)  # the tensor holds the mapping alive; it is unmapped when both are gone
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
