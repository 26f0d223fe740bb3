"""`kvforge learn`: runnable, measured demonstrations of why the KV cache is built the way it is.

- `why_cache`: the cost of no cache (NumPy `minimal_cache` + the real model, with and without)
- `prefill_decode`: prefill is compute-bound, decode memory-bound (`flops`, `probe`)
- `paging`: contiguous reservation vs paged blocks in equal memory (`kvforge.kv.contiguous`)
- `quant_at_length`: KV-quantization loss against context length, and the K-16-bit / per-head remedies
"""
