"""One tensor-parallel rank: a process that holds a shard of the model and its own KV cache.

Started by `TensorParallelExecutor` (torch.multiprocessing, spawn). It joins the process group
(gloo on CPU, NCCL on CUDA: the same code), loads the checkpoint, keeps its shard
(`parallel_layers.shard_model`) and then serves the engine's messages until told to stop:

- ("caches", per-layer block counts, cache format, block size): allocate this rank's caches
  (its own KV heads only), answer their bytes;
- ("step", per-layer block copies, input ids, positions, metadata, rows): run the forward pass;
  rank 0 answers the logits of `rows` (all-gathered over the vocabulary), the others an ack.

Every rank answers every message, so an error on any rank reaches the engine as a message naming
the rank; a rank that dies or hangs is caught by the engine (process liveness, timeouts).
Messages are pickled explicitly (`send_bytes`): tensors travel by value, no shared-memory handles.
"""
from __future__ import annotations

import os
import pickle
import traceback
from dataclasses import fields, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch


def _to_device(meta: Any, device: torch.device) -> Any:
    """AttentionMetadata (or one per layer) with its tensors on `device`."""
    if isinstance(meta, list):
        return [_to_device(m, device) for m in meta]
    from kvforge.attention.metadata import PrefillChunk

    changes = {}
    for f in fields(meta):
        value = getattr(meta, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.to(device)
        elif f.name == "prefills":
            changes[f.name] = [PrefillChunk(p.rows, p.start, p.seq_len, p.block_table.to(device)) for p in value]
    return replace(meta, **changes)


class _Rank:
    def __init__(self, rank: int, world: int, config: Any, device: torch.device) -> None:
        from kvforge.config import ModelConfig, torch_dtype
        from kvforge.engine.parallel.parallel_layers import shard_model
        from kvforge.models.linear import pack_linear_weights
        from kvforge.models.loader import load_checkpoint
        from kvforge.models.registry import build_model

        opts = config.model_options  # dtype already resolved by the engine ("auto" never reaches a rank)
        self.rank, self.world, self.device = rank, world, device
        checkpoint = load_checkpoint(opts.model)
        self.cfg = ModelConfig.from_hf(checkpoint.hf_config)
        model = build_model(self.cfg)
        model.load_weights(checkpoint.weights)
        del checkpoint
        shard_model(model, rank, world)
        self.dtype = torch_dtype(opts.dtype)
        self.model = model.to(dtype=self.dtype, device=device).eval()
        pack_linear_weights(self.model)
        if device.type == "cpu":  # off the scattered pages loading left (models/weight_pages.py)
            from kvforge import envs
            from kvforge.models.weight_pages import settle_weight_pages

            settle_weight_pages(self.model, envs.KVFORGE_WEIGHT_PAGES)
        self.caches: list = []
        self.layer_groups: list[int] = []

    def info(self) -> dict:
        from kvforge.engine.startup_report import _describe_linear, weights_bytes

        return {"weights_bytes": weights_bytes(self.model), "linear": _describe_linear(self.model),
                "device": str(self.device), "pid": os.getpid()}

    def make_caches(self, blocks_per_layer: list[int], layer_groups: list[int], fmt: Any, block_size: int) -> int:
        from kvforge.kv.storage.build import make_layer_caches
        from kvforge.engine.parallel.parallel_layers import kv_heads_of_rank

        cfg = self.cfg
        if not cfg.mla_latent_dim:
            cfg = replace(cfg, num_kv_heads=len(kv_heads_of_rank(cfg.num_heads, cfg.num_kv_heads, self.rank, self.world)))
        self.caches = []  # free the old ones first (reconfiguration)
        self.caches = make_layer_caches(cfg, fmt, blocks_per_layer, block_size, self.device, self.dtype)
        self.layer_groups = layer_groups
        return sum(c.nbytes for c in self.caches)

    @torch.inference_mode()
    def step(self, copies: list[list[tuple[int, int]]] | None, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: Any, rows: list[int] | None) -> torch.Tensor | None:
        if copies:  # each group's copies go to that group's layers only
            for layer, cache in enumerate(self.caches):
                pairs = copies[self.layer_groups[layer]]
                if pairs:
                    cache.copy_blocks(pairs)
        if input_ids is None:
            return None
        from kvforge.engine.model_runner import forward_rows

        hidden = forward_rows(self.model, input_ids.to(self.device), positions.to(self.device), self.caches,
                              _to_device(meta, self.device), rows)
        if hidden is None:  # nothing read this step (the same on every rank)
            return None
        logits = self.model.compute_logits(hidden)  # every rank joins the all-gather
        return logits.cpu() if self.rank == 0 else None


def worker_main(rank: int, world: int, master_addr: str, port: int, config: Any, conn: Connection,
                timeout_s: float) -> None:
    """Entry point of a spawned rank; never returns an exception to the parent, it sends it."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback unless the deployment says otherwise
    try:
        use_cuda = str(config.model_options.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        if use_cuda:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://{master_addr}:{port}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        state = _Rank(rank, world, config, device)
        conn.send_bytes(pickle.dumps(("ok", state.info())))
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "stop":
                break
            if msg[0] == "caches":
                reply: Any = state.make_caches(*msg[1:])
            elif msg[0] == "step":
                reply = state.step(*msg[1:])
            else:
                raise ValueError(f"unknown message {msg[0]!r}")
            conn.send_bytes(pickle.dumps(("ok", reply)))
    except (EOFError, KeyboardInterrupt):
        pass  # the engine went away
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", f"rank {rank}: {traceback.format_exc()}")))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
