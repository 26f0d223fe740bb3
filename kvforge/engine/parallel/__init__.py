"""Tensor parallelism on torch.distributed, inside the engine layer (the engine starts and drives the ranks).

- `parallel_layers`: column/row-parallel linears, vocab-parallel embedding and lm_head, and
  `shard_model`, which swaps them into an already loaded model (the load-time seam).
- `worker` / `executor`: the engine spawns one process per rank; the scheduler runs once in the
  engine and every step's batch is sent to all ranks, which answer (rank 0 with the logits).
- `setup`: start-up under tensor parallelism (per-rank caches, the per-device ledger rows).
"""
