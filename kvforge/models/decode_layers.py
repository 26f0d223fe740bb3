"""A decode step's decoder layers in one C call (`csrc/decode_layers.c`), for Llama-style models.

Why: once the panel kernels stream the weights at memory speed, a single-stream decode step spends
about a third of its time between kernels, in some fifteen Python calls per layer (module calls, views,
output tensors, ctypes argument checks). `run_decode_layers` hands the whole stack to one C loop that
calls the very kernels the Python path calls (fused RMSNorm / rotary / SiLU-and-multiply, the panel
linears, the CPU decode kernel), in the same order, so the hidden states are bitwise those of the
Python path; `tests/test_decode_layers.py` checks that, and greedy tokens against transformers stay
as they were.

It applies to steps of decode rows only, no more rows than the panel kernels take (all of them with
`KVFORGE_LINEAR=panel`, `PANEL_DECODE_ROWS` with `both`), fp32 or bf16, KV caches in the compute dtype
or 8-bit ones (int8, fp8; per-token, per-head or set per-tensor scales, and int8 K per channel: written
by the same C quantizer the stores use), read by the CPU decode kernel, one metadata for every layer, no attention-mass scoring (KV eviction), and models
whose layers are plain `LlamaDecoderLayer`s: packed q|k|v and gate|up without biases, SiLU, no q/k
norm, no MoE. The four matmuls of every layer are panel weights of the compute dtype, or all of them
weight-only int8 / int4 codes (`quantization=`, run by `quant_linear`'s kernel, as the Python layers
run them). Anything else returns None and the model runs its Python layers.
`KVFORGE_FUSED_LAYERS=0` turns it off.
"""
from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import torch

from kvforge import envs
from kvforge.attention import cpu_kernel
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.cpu_paged import kernel_views
from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv import quant_kernel, rotation
from kvforge.kv.storage.quantized import QuantizedKVCache
from kvforge.models import fused, panel_linear, quant_linear
from kvforge.models.layers import GatedMLP
from kvforge.models.linear import PANEL_DECODE_ROWS, Linear
from kvforge.native import NativeLibrary

_P, _I = ctypes.c_void_p, ctypes.c_int64
GRAN_TENSOR = quant_kernel.GRANULARITY_CODES["tensor"]


class _Fns(ctypes.Structure):
    _fields_ = [("linear", _P), ("qlinear", _P), ("rms_norm", _P), ("rotary", _P), ("silu_mul", _P), ("decode", _P), ("quantize", _P),
                ("hadamard", _P)]


class _Write(ctypes.Structure):
    """`kvf_write`: fmt 0 copies rows of the compute dtype, else quant_kernel's format/granularity codes."""
    _fields_ = [("data", _P), ("scales", _P), ("fmt", ctypes.c_int32), ("gran", ctypes.c_int32),
                ("static_scale", ctypes.c_float), ("hadamard", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", _P), ("ln2", _P), ("wqkv", _P), ("wo", _P), ("wgu", _P), ("wdown", _P),
                ("k_view", _P), ("v_view", _P), ("k_write", _Write), ("v_write", _Write), ("window", _I)]


class _QDesc(ctypes.Structure):
    """`kvf_qdesc` (linear_quant.c): one quantized weight, as `kvf_qlinear_desc` takes it."""
    _fields_ = [("codes", _P), ("scales", _P), ("offsets", _P), ("group", _I), ("bits", _I), ("act8", _I),
                ("perm", _P)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvf_decode_layers.restype = ctypes.c_int
    lib.kvf_decode_layers.argtypes = ([ctypes.POINTER(_Fns), ctypes.POINTER(_Layer), _I, _P] + [_I] * 6
                                      + [_P] * 5 + [_I, _I, ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int])


LIBRARY = NativeLibrary(
    Path(__file__).parent / "csrc" / "decode_layers.c", "KVFORGE_FUSED_LAYERS", "the fused decode layers", _declare,
)


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


def _layer_linears(layer: torch.nn.Module) -> list[Linear] | None:
    """The layer's four matmuls, when the layer is the plain Llama shape this path runs."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if (attn is None or type(mlp) is not GatedMLP or not mlp.fused_silu or attn.q_norm is not None
            or getattr(layer, "input_layernorm", None) is None or layer.input_layernorm.offset
            or layer.post_attention_layernorm.offset):
        return None
    linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    if any(type(m) is not Linear or m.bias is not None or (m.panel_weight is None and m.quant_weight is None)
           for m in linears):
        return None
    return linears


def _in_features(lin: Linear) -> int:
    return lin.quant_weight.k if lin.quant_weight is not None else lin.panel_weight.k


class _Plan:
    """What one model's stack needs, built once: per-layer pointers and the kernels' entry points."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        layers = model.model.layers
        self.linears = [_layer_linears(layer) for layer in layers]
        every = [m for ls in self.linears if ls is not None for m in ls]
        # one kernel for the whole stack: every matmul on panels of the compute dtype, or every one on codes
        self.quant = bool(every) and all(m.quant_weight is not None for m in every)
        self.ok = all(ls is not None for ls in self.linears) and (
            self.quant or all(m.quant_weight is None and m.panel_weight.dtype == dtype for m in every))
        if not self.ok:
            return
        attn = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.hidden = _in_features(attn.qkv_proj)
        self.inter = _in_features(layers[0].mlp.down_proj)
        self.eps = layers[0].input_layernorm.eps
        self.windows = [layer.self_attn.sliding_window or 0 for layer in layers]
        self.ok = (all(layer.input_layernorm.eps == self.eps and layer.post_attention_layernorm.eps == self.eps
                       for layer in layers)
                   and all((layer.self_attn.num_heads, layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
                           == (self.heads, self.kv_heads, self.head_dim) for layer in layers))
        # with a oneDNN layout beside the panel one, more rows than this go to oneDNN in the Python path
        self.max_rows = (PANEL_DECODE_ROWS if any(m.onednn_weight is not None for ls in self.linears for m in ls)
                         else 1 << 30)
        self.norms = [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight) for layer in layers]
        self.ok = self.ok and all(w.dtype == dtype and w.is_contiguous() and w.device.type == "cpu"
                                  for pair in self.norms for w in pair)
        # the caches the table points into, held weakly (a reconfigured engine frees its old pools), and
        # the per-tensor scales the table copied (a store's static scale can be set again)
        self.bound: list[weakref.ref] = []
        self.static_scales: list[tuple[object, float]] = []
        self.rotations: list[tuple[bool, bool]] = []  # each layer's (rotate_k, rotate_v) the table was built with
        self.table: ctypes.Array | None = None
        self.structs: list = []  # the decode kernel's operands the table points at (and per-tensor scales)
        self.num_blocks = self.block_size = 0
        # the quantized weights as `kvf_qdesc`s, one per matmul (the QuantWeights keep their tensors alive)
        self.qdescs = [[_qdesc(m.quant_weight) for m in ls] for ls in self.linears] if self.quant else []
        self.fns = _fns(dtype, self.quant, self.heads // self.kv_heads if self.heads % self.kv_heads == 0 else None)


def _qdesc(qw) -> _QDesc:  # type: ignore[no-untyped-def]
    return _QDesc(qw.codes.data_ptr(), qw.scales.data_ptr(), qw.offsets.data_ptr() if qw.offsets is not None else None,
                  qw.group, qw.bits, int(qw.act_int8), qw.perm.data_ptr() if qw.perm is not None else None)


def _enabled() -> bool:
    return bool(envs.KVFORGE_FUSED_LAYERS)


def _fns(dtype: torch.dtype, quant: bool = False, group: int | None = None) -> _Fns | None:
    """The kernels' entry points: the panel linear of `dtype`, or with `quant` the int8 / int4 one, and
    the attention library for `group` query heads per KV head."""
    lin = (quant_linear.LIBRARY.load() if quant else panel_linear.LIBRARY.load() if dtype == torch.float32
           else panel_linear.LIBRARY_BF16.load())
    ops, dec = fused.LIBRARY.load(), cpu_kernel.load_library(group)
    if lin is None or ops is None or dec is None:
        return None
    qnt = quant_kernel.LIBRARY.load()  # optional: without it, 8-bit caches keep the Python layers
    had = rotation.LIBRARY.load()  # optional: without it, rotated caches keep the Python layers
    dense = 0 if quant else _address(lin, "kvf_panel_linear" if dtype == torch.float32 else "kvf_panel_linear_bf16")
    return _Fns(dense, _address(lin, "kvf_qlinear_desc") if quant else 0, _address(ops, "kvf_rms_norm"), _address(ops, "kvf_rotary"), _address(ops, "kvf_silu_mul"),
                _address(dec, "kvf_paged_decode"), _address(qnt, "kvf_quantize_rows") if qnt is not None else 0,
                _address(had, "kvf_hadamard_rows") if had is not None else 0)


def run_decode_layers(
    model: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list,
    meta: AttentionMetadata | list,
) -> torch.Tensor | None:
    """x [M, hidden] after every decoder layer, computed in one C call; None when this step or model is
    outside the fused path's reach (the caller then runs its layers in Python)."""
    if not _enabled() or isinstance(meta, list) or meta.prefills or meta.attention_mass is not None:
        return None
    m = x.shape[0]
    if (meta.num_decodes != m or m == 0 or meta.backend not in ("cpu", "auto") or x.dtype not in
            (torch.float32, torch.bfloat16) or x.device.type != "cpu" or torch.is_grad_enabled()):
        return None
    plan = model.__dict__.get("_fused_decode_plan")  # built once per model (not a module attribute)
    if plan is None or plan.dtype != x.dtype:
        plan = model.__dict__["_fused_decode_plan"] = _Plan(model, x.dtype)
    if not plan.ok or m > plan.max_rows:
        return None
    lib = LIBRARY.load()
    if lib is None or plan.fns is None or not _bind_caches(plan, caches):
        return None
    key = ("cpu_decode", plan.num_blocks, plan.block_size)
    if key not in meta.derived:  # the same checked indices the Python path's attention layers share
        meta.derived[key] = cpu_kernel.decode_indices(meta.decode_block_tables, meta.decode_seq_lens,
                                                      plan.num_blocks, plan.block_size)
    idx = meta.derived[key]
    x = x.contiguous().clone()
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    # the C loop writes K/V at these slots unchecked, as index_copy_ would not be
    if int(slots.min()) < 0 or int(slots.max()) >= plan.num_blocks * plan.block_size:
        raise ValueError("KV write slots out of range of the pool")
    rc = lib.kvf_decode_layers(
        ctypes.byref(plan.fns), plan.table, len(plan.linears), x.data_ptr(), m, plan.hidden, plan.heads, plan.kv_heads,
        plan.head_dim, plan.inter, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), idx.tables.data_ptr(),
        idx.seq_lens.data_ptr(), plan.block_size, idx.tables.shape[1], plan.scale, plan.eps,
        0 if x.dtype == torch.float32 else 1, torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError(f"the fused decode layers could not allocate their scratch buffers (code {rc})")
    return x


def _write_for(store_or_pool, dtype: torch.dtype) -> _Write | None:
    """How the C loop writes one of K/V: rows copied (a pool in the compute dtype) or quantized (an 8-bit
    store with per-token/head scales, or a per-tensor scale already set); None: not here."""
    if isinstance(store_or_pool, torch.Tensor):
        data, fmt = store_or_pool, None
    else:
        data, fmt = store_or_pool.data, getattr(store_or_pool, "fmt", None)
    if not data.is_contiguous() or data.device.type != "cpu":
        return None
    if fmt is None:
        return _Write(data.data_ptr(), None, 0, 0, 0.0) if data.dtype == dtype else None
    gran = store_or_pool.granularity
    if fmt.name not in quant_kernel.FORMAT_CODES or gran not in quant_kernel.GRANULARITY_CODES:
        return None
    if gran == "channel" and fmt.name not in quant_kernel.CHANNEL_FORMATS:
        return None
    if gran == "tensor":
        if store_or_pool.static_scale is None:
            return None  # the first write calibrates it: the Python store does that one
        return _Write(data.data_ptr(), None, quant_kernel.FORMAT_CODES[fmt.name], quant_kernel.GRANULARITY_CODES[gran],
                      float(store_or_pool.static_scale))
    scales = store_or_pool.scale
    return _Write(data.data_ptr(), scales.data_ptr(), quant_kernel.FORMAT_CODES[fmt.name],
                  quant_kernel.GRANULARITY_CODES[gran], 0.0)


def _bound(plan: _Plan, caches: list) -> bool:
    """The table already points into these very caches, with the per-tensor scales they hold now and the
    rotations they store in now (a calibration may change them after a table was built)."""
    return (len(plan.bound) == len(caches) and all(ref() is c for ref, c in zip(plan.bound, caches))
            and all(float(store.static_scale) == value for store, value in plan.static_scales)
            and plan.rotations == _rotations(caches))


def _rotations(caches: list) -> list[tuple[bool, bool]]:
    return [(bool(getattr(c, "rotate_k", False)), bool(getattr(c, "rotate_v", False))) for c in caches]


def _bind_caches(plan: _Plan, caches: list) -> bool:
    """Point the per-layer table at these caches; rebuilt only when they (or a per-tensor scale) change, so a
    step does no per-layer Python work. The table holds raw pointers: valid while the caches live, which
    `_bound` checks through weak references before every use."""
    if _bound(plan, caches):
        return True
    if len(caches) != len(plan.linears):
        return False
    parts, statics = [], []
    for cache in caches:
        if type(cache) is DenseKVCache:
            pools = (cache.k, cache.v)
        elif type(cache) is QuantizedKVCache and plan.fns.quantize:
            pools = (cache.k_store, cache.v_store)
        else:
            return False
        k_view, v_view = kernel_views(cache)
        writes = [_write_for(p, plan.dtype) for p in pools]
        for w, rotated in zip(writes, (getattr(cache, "rotate_k", False), getattr(cache, "rotate_v", False))):
            if w is not None and rotated:  # stored Hadamard-rotated (kv/rotation.py): the C loop turns q/o too
                if not plan.fns.hadamard or rotation.hadamard_block(plan.head_dim) > rotation.HADAMARD_MAX:
                    return False
                w.hadamard = rotation.hadamard_block(plan.head_dim)
        if (k_view is None or v_view is None or any(w is None for w in writes)
                or (k_view.heads, k_view.dim, v_view.dim) != (plan.kv_heads, plan.head_dim, plan.head_dim)
                or (parts and k_view.data.shape[:2] != parts[0][0].data.shape[:2])):  # one set of indices
            return False
        parts.append((k_view, v_view, writes))
        statics += [(p, w.static_scale) for p, w in zip(pools, writes) if w.gran == GRAN_TENSOR]
    structs, rows = [], []
    for i, (linears, (ln1, ln2), window, (k_view, v_view, (k_write, v_write))) in enumerate(
            zip(plan.linears, plan.norms, plan.windows, parts)):
        kv = (k_view.struct(), v_view.struct())
        # a per-tensor scale may be a tensor of its own (store_view reshapes it): keep it alive, it is one
        # float; every other pointer is into the cache, which `_bound` checks is alive
        structs.append((kv, [v.scale for v in (k_view, v_view) if v.granularity == "tensor"]))
        if plan.quant:
            wqkv, wo, wgu, wdown = (ctypes.addressof(d) for d in plan.qdescs[i])
        else:
            wqkv, wo, wgu, wdown = (lin.panel_weight.packed.data_ptr() for lin in linears)
        rows.append(_Layer(ln1.data_ptr(), ln2.data_ptr(), wqkv, wo, wgu, wdown, ctypes.addressof(kv[0]),
                           ctypes.addressof(kv[1]), k_write, v_write, window))
    plan.table = (_Layer * len(rows))(*rows)
    plan.structs, plan.static_scales, plan.rotations = structs, statics, _rotations(caches)
    plan.bound = [weakref.ref(c) for c in caches]
    plan.num_blocks, plan.block_size = parts[0][0].num_blocks, parts[0][0].block_size
    return True
