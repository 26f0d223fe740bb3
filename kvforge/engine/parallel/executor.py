"""The engine side of tensor parallelism: start the ranks, broadcast each step, catch dead or hung ranks.

The scheduler and the sampler run once, in the engine's process (as in vLLM's multiprocess
executor); the ranks only run the model. Each step, `TensorParallelRunner` flattens the scheduled
chunks exactly as the single-device runner does and sends the same batch to every rank; rank 0
answers the logits. Waiting is never blind: the engine waits on the ranks' pipes *and* their process
sentinels, so a rank that dies is reported at once, and a rank that does not answer within
`distributed_timeout` seconds is reported as hung (the ranks' own collectives use the same timeout).
After a failure every rank is stopped and each later call raises the same error.
"""
from __future__ import annotations

import os
import pickle
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from kvforge.engine.errors import EngineFatal
from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.parallel.start import main_module_hidden


class RankFailure(EngineFatal):
    """A tensor-parallel rank died, hung or raised: the engine cannot continue."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop(procs: list, conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("stop",)))
        except OSError:
            pass
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)
    for conn in conns:
        conn.close()


class TensorParallelExecutor:
    """Spawns `tensor_parallel_size` ranks (loopback by default) and talks to all of them."""

    def __init__(self, config: Any, cfg: Any) -> None:
        """`config`: the EngineConfig (dtype already resolved), sent to every rank; `cfg`: the ModelConfig."""
        import torch.multiprocessing as mp

        from kvforge.engine.parallel.parallel_layers import check_tensor_parallel

        parallel = config.parallel_config
        check_tensor_parallel(cfg, parallel.tensor_parallel_size)  # a clear ValueError before any process starts
        self.world = parallel.tensor_parallel_size
        self.timeout = float(parallel.distributed_timeout)
        self.failure: str | None = None
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT") or _free_port(host))
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        with main_module_hidden():  # a script without a main guard is not re-run in every rank (start.py)
            for rank in range(self.world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_entry, args=(rank, self.world, host, port, config, child,
                                                            self.timeout), name=f"kvforge-tp{rank}", daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        # loading can take much longer than a step: the first answer gets a generous deadline
        self.rank_info: list[dict] = self._gather(max(self.timeout, 600.0), "start-up")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, *msg: Any) -> list[Any]:
        """Send `msg` to every rank and return their answers, or raise RankFailure."""
        if self.failure:
            raise RankFailure(self.failure)
        data = pickle.dumps(msg)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(f"tensor-parallel rank {rank} is gone ({self._exit(rank)}) before {msg[0]!r}")
        return self._gather(self.timeout, repr(msg[0]))

    def _exit(self, rank: int) -> str:
        p = self.procs[rank]
        p.join(0.5)
        code = p.exitcode
        return f"pid {p.pid}, exit code {code}" if code is not None else f"pid {p.pid}, still running"

    def _gather(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        replies: dict[int, Any] = {}
        while len(replies) < self.world:
            pending = [r for r in range(self.world) if r not in replies]
            for r in pending:
                conn = self.conns[r]
                if conn.poll():
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        self._fail(f"tensor-parallel rank {r} died during {what} ({self._exit(r)})")
                    if status == "error":
                        self._fail(f"tensor-parallel {value.strip()}")
                    replies[r] = value
            pending = [r for r in range(self.world) if r not in replies]
            if not pending:
                break
            for r in pending:
                if not self.procs[r].is_alive() and not self.conns[r].poll():
                    self._fail(f"tensor-parallel rank {r} died during {what} ({self._exit(r)})")
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"tensor-parallel rank(s) {pending} did not answer {what} within {timeout:g} s "
                           "(hung? raise distributed_timeout if steps are legitimately this slow)")
            wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], timeout=min(left, 1.0))
        return [replies[r] for r in range(self.world)]

    def _fail(self, message: str) -> None:
        self.failure = message + "; the engine stopped its other ranks and cannot continue"
        self.shutdown()
        raise RankFailure(self.failure)

    def shutdown(self) -> None:
        self._finalizer()


def _worker_entry(*args: Any) -> None:
    from kvforge.engine.parallel.worker import worker_main

    worker_main(*args)


class TensorParallelRunner(ModelRunner):
    """ModelRunner whose forward passes run on the tensor-parallel ranks; sampling stays here."""

    def __init__(self, executor: TensorParallelExecutor, layer_groups: list[int], block_size: int, seed: int,
                 attention_backend: str) -> None:
        super().__init__(None, [], layer_groups, block_size, torch.device("cpu"), seed,  # type: ignore[arg-type]
                         attention_backend)
        self.executor = executor
        self._copies: list | None = None

    def _copy_blocks(self, by_group: list[list[tuple[int, int]]]) -> None:
        """Queued for every rank's next forward pass (in order, even across steps that ran no model)."""
        if self._copies is None:
            self._copies = [list(pairs) for pairs in by_group]
        else:
            for pending, pairs in zip(self._copies, by_group):
                pending.extend(pairs)

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                        rows: list[int] | None) -> torch.Tensor | None:
        copies, self._copies = self._copies, None
        return self.executor.call("step", copies, input_ids, positions, meta, rows)[0]
