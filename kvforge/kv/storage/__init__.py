"""Where each layer's KV bytes live: the paged storage classes, one module per layout.

`layer_cache` (the `LayerKVCache` interface and the shared block read), `dense`,
`quantized` (K and V in any mix of formats, over `k_or_v_stores`), `mla_latent`
(one latent per token for MLA) and `build` (which class each layer gets). These
hold torch tensors; the block bookkeeping above them (kvforge.kv) stays pure.
"""
