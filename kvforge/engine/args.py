"""EngineArgs: every engine option in one validated place, shared by LLM, the CLI and the server."""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields

from kvforge.config import KV_CACHE_DTYPES, KV_CACHE_SCALES, SUPPORTED_DTYPES, CacheConfig
from kvforge.ledger import parse_bytes

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither kv_cache_memory nor num_kv_blocks is given


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None  # None = the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str = "float32"
    device: str | None = None  # None = cuda when available, else cpu
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"  # auto (model dtype), float16, bfloat16, float32, fp8 (= fp8_e4m3), fp8_e5m2, int8, int4
    k_cache_dtype: str | None = None  # K alone (None: kv_cache_dtype), e.g. "auto" to keep K in the model dtype
    v_cache_dtype: str | None = None  # V alone (None: kv_cache_dtype)
    kv_cache_scale: str = "token"  # quantization scales: token, head, channel (K only), tensor (static, calibrated)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str = "auto"  # "torch" (reference), "sdpa" (fused), "cpu" (in-place C decode), "auto"
    log_ledger: bool = True
    tensor_parallel_size: int = 1  # ranks the model is sharded over (torch.distributed: gloo on CPU, NCCL on CUDA)
    distributed_timeout: float = 300.0  # seconds a rank may take to answer a step before it is declared hung

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        from kvforge.attention import check_backend  # torch-heavy: imported only when an engine is configured

        check_backend(self.attention_backend)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if not isinstance(self.distributed_timeout, (int, float)) or not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be a positive number of seconds, got {self.distributed_timeout!r}")
        if tp > 1 and self.kv_cache_scale == "tensor":
            raise ValueError("kv_cache_scale='tensor' is calibrated in one process; it is not supported with "
                             "tensor_parallel_size > 1 (use token, head or channel)")
        self.cache_config()  # validates block_size, num_kv_blocks, kv_cache_dtype, k/v_cache_dtype, kv_cache_scale

    def cache_config(self) -> CacheConfig:
        memory = self.kv_cache_memory
        if memory is None and self.num_kv_blocks is None:
            memory = DEFAULT_KV_CACHE_MEMORY
        return CacheConfig(
            self.block_size, memory, self.num_kv_blocks, self.kv_cache_dtype, self.enable_prefix_caching,
            self.k_cache_dtype, self.v_cache_dtype, self.kv_cache_scale,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def add_engine_cli_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags every serving command shares (`kvforge generate|chat|serve|bench`)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder, .gguf file, or omitted for SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB (default 1GiB)")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="K and V storage: auto (model dtype), 16/32-bit floats, fp8 (e4m3), fp8_e5m2, int8, int4")
    g.add_argument("--k-cache-dtype", default=None, choices=KV_CACHE_DTYPES, help="K alone (overrides --kv-cache-dtype)")
    g.add_argument("--v-cache-dtype", default=None, choices=KV_CACHE_DTYPES, help="V alone (overrides --kv-cache-dtype)")
    g.add_argument("--kv-cache-scale", default="token", choices=KV_CACHE_SCALES,
                   help="quantization scales: per token, per head, per channel (K only, per block), per tensor (static)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over N ranks started by the engine (gloo on CPU, NCCL on CUDA; loopback "
                        "unless MASTER_ADDR is set)")
    g.add_argument("--distributed-timeout", type=float, default=300.0,
                   help="seconds a tensor-parallel rank may take to answer before the engine reports it hung")
    g.add_argument("--attention-backend", default="auto", choices=("auto", "cpu", "sdpa", "torch"),
                   help="auto (default) = cpu on CPU when a C compiler is present, else sdpa; cpu = in-place C decode "
                        "kernel + SDPA prefill; sdpa = PyTorch fused kernels; torch = reference implementation")


def engine_args_from_cli(args: argparse.Namespace, **overrides: object) -> EngineArgs:
    names = {f.name for f in fields(EngineArgs)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return EngineArgs(**values)
