"""KV tiers: a second-level prefix cache below the device block pool.

When the device pool evicts a cached block, its bytes go to the host tier
(a pre-allocated pool, pinned on CUDA) and the disk tier (one content-addressed
file per block). A prefix lookup that misses the device pool continues into the
tiers; hit blocks are loaded into fresh device blocks before the request's
prefill chunk runs. Keys cover the block hash chain (which carries cache_salt)
and a namespace (model fingerprint, KV format, block size, per-layer layout), so
a tier never serves another model's or tenant's KV.

Modules: `lru` and `keys` (bookkeeping, no torch), `disk` (files, no torch),
`host` (a torch pool), `block_io` (per-layout export/import of block bytes),
`tiers` (the coordinator the KV manager and the model runner talk to), `cost`
(swap-or-recompute from measured rates, no torch).
"""
