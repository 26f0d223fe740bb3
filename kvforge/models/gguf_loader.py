"""Read a llama.cpp GGUF file into HF-named float32 weights and an HF-style config.

The tokenizer stored beside them is rebuilt by `kvforge.gguf_tokenizer`.

GGUF stores what `convert_hf_to_gguf.py` wrote: llama.cpp tensor names
(`blk.0.attn_q.weight`), quantized blocks, and a few per-architecture
rewrites of the HF tensors. We dequantize, rename and undo each rewrite so the
rest of kvforge sees exactly what an HF checkpoint holds:
- llama: q/k projection rows permuted from HF's "rotate half" rope layout into
  llama.cpp's interleaved-pairs layout (un-permuted here);
- gemma2/gemma3: RMSNorm weights stored as (1 + w), because llama.cpp's norm
  multiplies by the weight while Gemma's multiplies by (1 + w) (1 subtracted here);
- deepseek2: routed experts stacked into one 3-D tensor per projection
  (unstacked here) and, in newer files, kv_b_proj split into a transposed k_b
  and a v_b for absorbed MLA (joined back here).
Hyper-parameters llama.cpp hard-codes per architecture instead of storing
(Gemma's local/global layer pattern and local rope base) are restored from the
same rules llama.cpp applies.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvforge.gguf_tokenizer import field
from kvforge.models import gguf_quant
from kvforge.models.weight_source import Block, WeightSource, drop_pages, rows_per_block

logger = logging.getLogger(__name__)

# llama.cpp tensor name (inside blk.N) -> HF module path (inside model.layers.N), llama family
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms per layer: llama.cpp's ffn_norm is Gemma's *pre*-feed-forward norm.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_DEEPSEEK2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Stacked routed experts [n_expert, rows, cols] -> one HF projection per expert.
_EXPERT_PROJS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp derives from config (Llama-3.1 rope frequencies); HF recomputes them.
_IGNORED = {"rope_freqs.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

Meta = Callable[..., Any]  # meta(key, default=None): one `{arch}.key` metadata value


def _f32(x: float) -> float:
    """GGUF stores floats as f32; give back the short decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


# ---- per-architecture config -------------------------------------------------


def _llama_config(cfg: dict, meta: Meta, names: set[str]) -> None:
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    cfg["mlp_bias"] = False


def _no_extra_config(cfg: dict, meta: Meta, names: set[str]) -> None:
    """Qwen2: the common fields say everything (its q/k/v biases are implied by the model type)."""


def _layer_types(n_layers: int, period: int, window: int | None) -> list[str]:
    """llama.cpp's swa pattern: in every `period` layers, the last one is global, the rest slide."""
    if not window:
        return ["full_attention"] * n_layers
    return ["sliding_attention" if i % period < period - 1 else "full_attention" for i in range(n_layers)]


def _gemma_common(cfg: dict, meta: Meta, size_27b_layers: int) -> None:
    """Fields Gemma 2 and 3 share; the attention scale follows llama.cpp's (gemma_pytorch's) rule.

    GGUF has no query_pre_attn_scalar: llama.cpp uses hidden/heads for the 27B models
    (recognised by their layer count) and head_dim for every other size, as the HF configs do.
    """
    cfg["hidden_act"] = cfg["hidden_activation"] = "gelu_pytorch_tanh"
    big = cfg["num_hidden_layers"] == size_27b_layers
    cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    final_cap = meta("final_logit_softcapping")
    cfg["final_logit_softcapping"] = _f32(final_cap) if final_cap else None
    cfg["attention_bias"] = False


def _gemma2_config(cfg: dict, meta: Meta, names: set[str]) -> None:
    _gemma_common(cfg, meta, size_27b_layers=46)
    attn_cap = meta("attn_logit_softcapping")
    cfg["attn_logit_softcapping"] = _f32(attn_cap) if attn_cap else None
    window = int(meta("attention.sliding_window", 4096))  # llama.cpp's default for Gemma 2
    cfg["sliding_window"] = window
    cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], 2, window)


def _gemma3_config(cfg: dict, meta: Meta, names: set[str]) -> None:
    """Gemma 3 text: every 6th layer global; local layers use rope base 10k, unscaled (llama.cpp's rule)."""
    _gemma_common(cfg, meta, size_27b_layers=62)
    cfg["model_type"] = "gemma3_text"
    cfg["attn_logit_softcapping"] = None
    window = meta("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    cfg["layer_types"] = _layer_types(cfg["num_hidden_layers"], 6, window)
    cfg["rope_local_base_freq"] = _f32(meta("rope.freq_base_swa", 10000.0))


def _deepseek2_config(cfg: dict, meta: Meta, names: set[str]) -> None:
    """MLA and MoE fields; handles both the older (attn_kv_b) and newer (k_b/v_b) file layouts.

    Newer files describe attention as MQA over the latent (key_length = kv_lora_rank + rope
    dim, head_count_kv 1) and put the per-head sizes in key_length_mla / value_length_mla.
    """
    rope_dim = int(meta("rope.dimension_count"))
    qk_dim = int(meta("attention.key_length_mla") or meta("attention.key_length"))
    v_dim = int(meta("attention.value_length_mla") or meta("attention.value_length"))
    n_group = int(meta("expert_group_count") or 1)
    sigmoid = int(meta("expert_gating_func") or 1) == 2  # llama.cpp: 1 softmax (default for V2), 2 sigmoid
    cfg.update(
        num_key_value_heads=cfg["num_attention_heads"],
        head_dim=rope_dim,
        q_lora_rank=int(meta("attention.q_lora_rank") or 0) or None,
        kv_lora_rank=int(meta("attention.kv_lora_rank")),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=qk_dim - rope_dim,
        v_head_dim=v_dim,
        moe_intermediate_size=int(meta("expert_feed_forward_length")),
        n_routed_experts=int(meta("expert_count")),
        num_experts_per_tok=int(meta("expert_used_count")),
        n_shared_experts=int(meta("expert_shared_count") or 0),
        first_k_dense_replace=int(meta("leading_dense_block_count") or 0),
        moe_layer_freq=1,
        routed_scaling_factor=_f32(meta("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(meta("expert_weights_norm", False)),
        scoring_func="sigmoid" if sigmoid else "softmax",
        n_group=n_group,
        topk_group=int(meta("expert_group_used_count") or 1),
        topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if n_group > 1 else "greedy"),
        attention_bias=False,
    )
    if sigmoid:  # DeepSeek-V3/R1 files are filed under deepseek2 too
        cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], rope_interleave=True)
    if cfg.get("rope_scaling", {}).get("rope_type") == "yarn":
        cfg["rope_scaling"].update(_yarn_fields(meta))


def _yarn_fields(meta: Meta) -> dict:
    """llama.cpp keeps only 0.1 * mscale_all_dim and assumes mscale == mscale_all_dim (true of DeepSeek)."""
    mscale = round(_f32(meta("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
    return {
        "mscale": mscale,
        "mscale_all_dim": mscale,
        "beta_fast": _f32(meta("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": _f32(meta("rope.scaling.yarn_beta_slow", 1.0)),
    }


@dataclass(frozen=True)
class _Arch:
    """How one llama.cpp architecture maps back to its HF checkpoint."""

    model_type: str
    hf_class: str
    layer_names: dict[str, str]
    config: Callable[[dict, Meta, set[str]], None]
    permute_qk: bool = False  # q/k rows permuted into llama.cpp's rope layout
    norm_shift: float = 0.0  # RMSNorm weights stored as (w + norm_shift)


_ARCHS = {
    "llama": _Arch("llama", "LlamaForCausalLM", _LAYER_NAMES, _llama_config, permute_qk=True),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", _LAYER_NAMES, _no_extra_config),
    "gemma2": _Arch("gemma2", "Gemma2ForCausalLM", _GEMMA_LAYER_NAMES, _gemma2_config, norm_shift=1.0),
    "gemma3": _Arch("gemma3", "Gemma3ForCausalLM", _GEMMA_LAYER_NAMES, _gemma3_config, norm_shift=1.0),
    "deepseek2": _Arch("deepseek_v2", "DeepseekV2ForCausalLM", _DEEPSEEK2_LAYER_NAMES, _deepseek2_config),
}


def _arch(reader: Any) -> tuple[str, _Arch]:
    arch = field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHS)}")
    return arch, _ARCHS[arch]


def _vocab_size(reader: Any, meta: Meta) -> int:
    """Rows of the embedding (llama.cpp may pad or trim the tokenizer's list), else the metadata's count."""
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is not None:
        return int(embd.shape[-1])  # GGUF shapes are innermost-first: [hidden, vocab]
    return int(meta("vocab_size") or len(field(reader, "tokenizer.ggml.tokens", [])))


def gguf_hf_config(reader: Any) -> dict:
    """Synthesize the HF `config.json` dict this GGUF was converted from."""
    arch, spec = _arch(reader)
    model_type, cls_name = spec.model_type, spec.hf_class
    if arch == "llama" and "mistral" in str(field(reader, "general.name", "")).lower():
        model_type, cls_name = "mistral", "MistralForCausalLM"  # llama.cpp files Mistral under llama

    def meta(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [cls_name],
        "vocab_size": _vocab_size(reader, meta),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = meta("rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": _f32(meta("rope.scaling.factor", 1.0))}
        orig = meta("rope.scaling.original_context_length")
        if orig:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    if "rope_freqs.weight" in names:
        logger.warning("GGUF has rope_freqs (Llama-3.1 rope scaling), which is not reconstructed")
    spec.config(cfg, meta, names)
    return cfg


# ---- tensors -------------------------------------------------------------------


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for ignorable tensors."""
    if gguf_name in _IGNORED:
        return None
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part == "exp_probs_b":  # DeepSeek-V3's routing bias, a bare parameter in HF
            return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        names = _ARCHS[arch].layer_names if arch in _ARCHS else _LAYER_NAMES
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name (unsupported model variant?)")


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of q/k rows (weights or biases).

    convert_hf_to_gguf reshapes each head's rows as (2, head_dim/2) -- HF's two
    rotated halves -- and swaps to (head_dim/2, 2) so rope pairs are adjacent.
    The inverse reads rows as (head_dim/2, 2) and swaps back.
    """
    rows = w.shape[0]
    assert rows % (2 * n_heads) == 0, (rows, n_heads)
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Rebuild HF's kv_b_proj [heads * (nope + v), kv_lora_rank] from llama.cpp's split halves.

    The converter viewed kv_b_proj as [heads, nope + v, rank], split it, and stored k_b
    transposed ([heads, rank, nope], ready for absorbing into q) and v_b as is ([heads, v, rank]).
    """
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not fit together")
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return kv.reshape(-1, kv.shape[-1])


def _dequantized(t: Any, r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """Tensor `t` (or its rows [r0, r1)) as float32."""
    from gguf.quants import dequantize

    data = t.data if r0 == 0 and r1 is None else t.data[r0:r1]
    if int(t.tensor_type) in gguf_quant.KEPT_TYPES and len(t.shape) == 2:
        return gguf_quant.dequantize(data, int(t.tensor_type), len(data), int(t.shape[0]))
    arr = dequantize(data, t.tensor_type)
    if arr.dtype != np.float32 or not arr.flags.writeable:  # F32 tensors come back as file views
        arr = np.array(arr, dtype=np.float32)
    return torch.from_numpy(arr)


def _hf_tensors(name: str, w: torch.Tensor, arch: str, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensor(s) one GGUF tensor becomes, with the architecture's rewrite undone."""
    spec = _ARCHS[arch]
    m = _BLOCK.match(name)
    part = m.group(2) if m else name.rpartition(".")[0]
    if m and part in _EXPERT_PROJS:
        layer, _, kind = m.groups()
        for e in range(w.shape[0]):
            yield f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_PROJS[part]}.{kind}", w[e].contiguous()
        return
    hf = hf_tensor_name(name, arch)
    if hf is None:
        return
    proj = hf.split(".")[-2]
    if spec.permute_qk and proj in ("q_proj", "k_proj"):
        w = unpermute_rope_rows(w, cfg["num_attention_heads" if proj == "q_proj" else "num_key_value_heads"])
    if spec.norm_shift and part.endswith("norm"):
        w = w - spec.norm_shift
    yield hf, w.contiguous()


class GGUFSource(WeightSource):
    """A GGUF file's tensors under their HF names, dequantized to float32 one tensor at a time (2-D tensors
    that need no rewrite, such as the embedding, a block of rows at a time), each one's mapped pages
    dropped once it is used."""

    def __init__(self, reader: Any, cfg: dict) -> None:
        self.reader, self.cfg = reader, cfg
        self.arch, self.spec = _arch(reader)
        by_name = {t.name: t for t in reader.tensors}
        self.shapes = {}
        self._yields: dict[str, set[str]] = {}  # GGUF tensor name -> the HF names it becomes
        for t in reader.tensors:
            shape = tuple(reversed([int(d) for d in t.shape]))  # GGUF lists the fastest dimension first
            if t.name in _IGNORED or (t.name.endswith((".attn_k_b.weight", ".attn_v_b.weight"))
                                      and t.name.replace(".attn_k_b.", ".attn_kv_b.").replace(".attn_v_b.", ".attn_kv_b.") in by_name):
                continue
            if t.name.endswith(".attn_v_b.weight"):
                continue  # joined with attn_k_b
            if t.name.endswith(".attn_k_b.weight"):
                v = by_name.get(t.name.replace(".attn_k_b.", ".attn_v_b."))
                if v is None:
                    raise ValueError(f"GGUF has {t.name!r} but no {t.name.replace('.attn_k_b.', '.attn_v_b.')!r}")
                vs = tuple(reversed([int(d) for d in v.shape]))
                hf = hf_tensor_name(t.name.replace(".attn_k_b.", ".attn_kv_b."), self.arch)
                self.shapes[str(hf)] = (shape[0] * (shape[2] + vs[1]), shape[1])
                self._yields[t.name] = {str(hf)}
                continue
            m = _BLOCK.match(t.name)
            if m and m.group(2) in _EXPERT_PROJS:
                layer, part, kind = m.groups()
                names = {f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_PROJS[part]}.{kind}" for e in range(shape[0])}
                self.shapes.update((n, shape[1:]) for n in names)
                self._yields[t.name] = names
                continue
            hf = hf_tensor_name(t.name, self.arch)
            if hf is not None:
                self.shapes[hf] = shape
                self._yields[t.name] = {hf}
        self._by_name = by_name

    def _whole(self, t: Any) -> Iterator[tuple[str, torch.Tensor]]:
        if t.name.endswith(".attn_k_b.weight"):
            v = self._by_name[t.name.replace(".attn_k_b.", ".attn_v_b.")]
            joined = join_kv_b(_dequantized(t), _dequantized(v))
            yield from _hf_tensors(t.name.replace(".attn_k_b.", ".attn_kv_b."), joined, self.arch, self.cfg)
            self._drop(v)
        else:
            yield from _hf_tensors(t.name, _dequantized(t), self.arch, self.cfg)

    def _drop(self, t: Any, r0: int = 0, r1: int | None = None) -> None:
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is not None:
            row = t.n_bytes // max(1, len(t.data)) if t.data.ndim else t.n_bytes
            drop_pages(mm, t.data_offset + r0 * row, t.data_offset + (len(t.data) if r1 is None else r1) * row)

    def blocks(self, wanted: set[str] | None = None) -> Iterator[Block]:
        for t in self.reader.tensors:
            hf = hf_tensor_name(t.name, self.arch) if len(t.shape) == 2 and t.name not in _IGNORED else None
            simple = hf is not None and not (self.spec.permute_qk and hf.split(".")[-2] in ("q_proj", "k_proj"))
            if simple:
                if wanted is not None and hf not in wanted:
                    continue
                shape = self.shapes[hf]
                step = rows_per_block(shape)
                for r0 in range(0, shape[0], step):
                    t0 = time.perf_counter()
                    rows = _dequantized(t, r0, r0 + step)
                    self.read_seconds += time.perf_counter() - t0
                    yield Block(hf, r0, rows, shape)
                    self._drop(t, r0, r0 + len(rows))
                continue
            if t.name in _IGNORED or t.name.endswith(".attn_v_b.weight"):
                continue
            if t.name.endswith(".attn_k_b.weight") and t.name.replace(".attn_k_b.", ".attn_kv_b.") in self._by_name:
                continue
            if wanted is not None and not self._yields.get(t.name, set()) & wanted:
                continue  # reading one tensor must not dequantize the others
            t0 = time.perf_counter()
            out = [(n, w) for n, w in self._whole(t) if wanted is None or n in wanted]
            self.read_seconds += time.perf_counter() - t0
            for n, w in out:
                yield Block(n, 0, w, tuple(w.shape))
            del out
            self._drop(t)


def file_codes(path: str, num_heads: int, num_kv_heads: int, reader: Any = None
               ) -> dict[str, Callable[[], gguf_quant.Codes]]:
    """HF weight name -> a call that converts that GGUF tensor's blocks (read from the memory-mapped file
    only when called), for every 2-D tensor of a kept type; q/k rows unpermuted as the loader does. `reader`:
    the file already opened by the loader (`GGUFSource.reader`), so its header is not parsed again."""
    from kvforge.gguf_file import GGUFFile

    reader = reader if reader is not None else GGUFFile(path)
    arch, spec = _arch(reader)
    out: dict[str, Callable[[], gguf_quant.Codes]] = {}
    for t in reader.tensors:
        if int(t.tensor_type) not in gguf_quant.KEPT_CONVERTERS or len(t.shape) != 2:
            continue
        try:
            hf = hf_tensor_name(t.name, arch)
        except ValueError:
            continue
        if hf is None:
            continue
        proj = hf.split(".")[-2]
        heads = (num_heads if proj == "q_proj" else num_kv_heads) if spec.permute_qk and proj in ("q_proj", "k_proj") else 0

        def convert(t: Any = t, heads: int = heads) -> gguf_quant.Codes:
            k, n = (int(x) for x in t.shape)  # GGUF lists the fastest dimension first
            codes, scales, offsets, bits, group = gguf_quant.gguf_codes(t.data, int(t.tensor_type), n, k)
            if heads:
                codes, scales = unpermute_rope_rows(codes, heads), unpermute_rope_rows(scales, heads)
                offsets = unpermute_rope_rows(offsets, heads) if offsets is not None else None
            return codes, scales, offsets, bits, group

        out[hf] = convert
    return out
