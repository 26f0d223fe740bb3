"""Beyond one engine: KV-affinity routing of replicas (tensor parallelism lives in kvforge/engine/parallel).

- `router`: the torch-free KV-affinity router (block-hash events per replica, load guard).
- `ray_serve`: the Ray Serve deployment (optional extra `kvforge[ray]`); it serves with kvforge/server's code.
"""
