"""Beyond one device: tensor parallelism on torch.distributed, KV-affinity routing of replicas.

- `parallel_layers`: column/row-parallel linears, vocab-parallel embedding and lm_head, and
  `shard_model`, which swaps them into an already loaded model (the load-time seam).
- `worker` / `executor`: the engine spawns one process per rank; the scheduler runs once in the
  engine and every step's batch is sent to all ranks, which answer (rank 0 with the logits).
- `router`: the torch-free KV-affinity router (block-hash events per replica, load guard).
- `ray_serve`: the Ray Serve deployment (optional extra `kvforge[ray]`).
"""
