"""Write tiny HF models and tokenizers as GGUF files, the way llama.cpp's convert_hf_to_gguf.py does.

Deliberately independent of kvforge's loader tables: the names and rewrites here are
written from llama.cpp's side (gguf-py's tensor names, the converter's transforms), so
a loader that undoes them wrongly fails the round trip. Rewrites reproduced:
- Gemma 2/3: every RMSNorm weight stored as (w + 1); Gemma 2's tied lm_head dropped;
- DeepSeek-V2: MLA metadata, routed experts stacked into 3-D tensors, and kv_b_proj either
  kept (older converter) or split into a transposed k_b and a v_b (newer converter);
- sentencepiece vocabularies as tokens + scores + token types (byte pieces `<0xXX>`).
All tensors are written as f32.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
from gguf.quants import quantize as gguf_quantize

# HF module path inside model.layers.N -> llama.cpp name inside blk.N
_COMMON = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA = {
    **_COMMON,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_DEEPSEEK = {
    **_COMMON,
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _f32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().float().numpy())


# ---- vocabularies ----------------------------------------------------------------


def add_spm_vocab(w: GGUFWriter, tokens: list[str], scores: list[float], types: list[int], *,
                  bos: int, eos: int, unk: int, add_space_prefix: bool = True,
                  add_bos: bool | None = None, add_eos: bool | None = None) -> None:
    """A sentencepiece ("llama") vocabulary, as llama.cpp's _set_vocab_sentencepiece writes it."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    w.add_add_space_prefix(add_space_prefix)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)


def sentencepiece_vocab(sp: Any, user_defined: frozenset[str] = frozenset()) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of a `sentencepiece.SentencePieceProcessor`, typed like llama.cpp does.

    The .model file does not say which pieces are user-defined; the converter learns that
    from the HF tokenizer_config's added tokens, which `user_defined` stands in for.
    """
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if tokens[-1] in user_defined:
            types.append(TokenType.USER_DEFINED)
        elif sp.is_unknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    return tokens, scores, types


def tiny_spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A Gemma-shaped sentencepiece vocabulary of exactly `size` pieces (pad, eos, bos, unk, bytes, words)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.BYTE] * 256
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581a", "\u2581t", "th", "\u2581th", "he", "\u2581the"]
    for i in range(size - len(tokens)):
        tokens.append(pieces[i] if i < len(pieces) else f"\u2581w{i}")
        types.append(TokenType.NORMAL)
    scores = [0.0] * 260 + [-float(i) for i in range(size - 260)]
    return tokens, scores, types


def add_gpt2_vocab_from_folder(w: GGUFWriter, folder: str, size: int) -> None:
    """The byte-level BPE tokenizer.json of a tiny model folder, padded with [PAD] pieces like llama.cpp."""
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tj["added_tokens"]}
    tokens, types = [], []
    for i in range(size):
        if i in special:
            tokens.append(special[i]), types.append(TokenType.CONTROL)
        elif i in by_id:
            tokens.append(by_id[i]), types.append(TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]"), types.append(TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_eos_token_id(min(special))


# ---- models ------------------------------------------------------------------------


# GGUFWriter method -> HF config attribute, for keys written straight from the config
_COMMON_KEYS = {
    "add_block_count": "num_hidden_layers",
    "add_context_length": "max_position_embeddings",
    "add_embedding_length": "hidden_size",
    "add_feed_forward_length": "intermediate_size",
    "add_head_count": "num_attention_heads",
    "add_layer_norm_rms_eps": "rms_norm_eps",
}
_DEEPSEEK_KEYS = {
    "add_vocab_size": "vocab_size",
    "add_leading_dense_block_count": "first_k_dense_replace",
    "add_kv_lora_rank": "kv_lora_rank",
    "add_expert_feed_forward_length": "moe_intermediate_size",
    "add_expert_count": "n_routed_experts",
    "add_expert_used_count": "num_experts_per_tok",
    "add_expert_shared_count": "n_shared_experts",
    "add_expert_weights_scale": "routed_scaling_factor",
    "add_expert_weights_norm": "norm_topk_prob",
    "add_rope_dimension_count": "qk_rope_head_dim",
    # optional ones: written only when the config has them
    "add_q_lora_rank": "q_lora_rank",
    "add_expert_group_count": "n_group",
    "add_expert_group_used_count": "topk_group",
}


def _write_keys(w: GGUFWriter, c: Any, table: dict[str, str]) -> None:
    for method, attr in table.items():
        value = getattr(c, attr, None)
        if value is not None:
            getattr(w, method)(value)


def _gemma_params(w: GGUFWriter, c: Any, arch: str) -> None:
    _write_keys(w, c, _COMMON_KEYS)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])


def _deepseek_params(w: GGUFWriter, c: Any, split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters; the newer converter describes MLA as MQA over the latent."""
    _write_keys(w, c, {**_COMMON_KEYS, **_DEEPSEEK_KEYS})
    rope_dim, nope = c.qk_rope_head_dim, c.qk_nope_head_dim
    if split_kv_b:
        w.add_head_count_kv(1)
        w.add_key_length(c.kv_lora_rank + rope_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(nope + rope_dim)
        w.add_value_length_mla(c.v_head_dim)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(nope + rope_dim)
        w.add_value_length(c.v_head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    scoring = getattr(c, "scoring_func", None) or ("sigmoid" if c.model_type == "deepseek_v3" else "softmax")
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if scoring == "sigmoid" else ExpertGatingFuncType.SOFTMAX)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _split_kv_b(kv_b: torch.Tensor, c: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The newer converter's MLA split: k_b transposed to [heads, rank, nope], v_b [heads, v, rank]."""
    kv = kv_b.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, kv_b.shape[-1])
    k_b, v_b = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
    return k_b.transpose(1, 2), v_b


def _layer_tensors(sd: dict[str, torch.Tensor], names: dict[str, str], c: Any, arch: str,
                   split_kv_b: bool) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for hf, t in sd.items():
        if not hf.startswith("model.layers."):
            continue
        _, _, layer, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if ".experts." in module:  # mlp.experts.E.gate_proj -> stacked ffn_gate_exps
            _, _, e, proj = module.split(".")
            experts.setdefault((layer, proj), {})[int(e)] = t
            continue
        if module == "mlp.gate" and kind == "e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = _f32(t)
            continue
        if module == "self_attn.kv_b_proj" and split_kv_b:
            k_b, v_b = _split_kv_b(t, c)
            out[f"blk.{layer}.attn_k_b.{kind}"], out[f"blk.{layer}.attn_v_b.{kind}"] = _f32(k_b), _f32(v_b)
            continue
        if arch.startswith("gemma") and module.endswith("norm"):
            t = t + 1
        out[f"blk.{layer}.{names[module]}.{kind}"] = _f32(t)
    for (layer, proj), per_expert in experts.items():
        stacked = torch.stack([per_expert[e] for e in range(len(per_expert))])
        out[f"blk.{layer}.ffn_{proj.split('_')[0]}_exps.weight"] = _f32(stacked)
    return out


def _global_tensors(sd: dict[str, torch.Tensor], arch: str, tied: bool) -> dict[str, np.ndarray]:
    out = {}
    for hf, t in sd.items():
        if hf.startswith("model.layers."):
            continue
        base, kind = hf.rsplit(".", 1)
        if base == "lm_head" and (tied or arch == "gemma2"):
            continue  # llama.cpp reuses token_embd; Gemma 2's converter always drops lm_head
        if arch.startswith("gemma") and base == "model.norm":
            t = t + 1
        out[f"{_GLOBAL[base]}.{kind}"] = _f32(t)
    return out


def export_model(folder: str, config: Any, path: str, arch: str, *, split_kv_b: bool = True,
                 quantize: GGMLQuantizationType | None = None) -> str:
    """Write the HF checkpoint in `folder` as llama.cpp's converter would; returns `path`. `quantize`: the
    blocks' linear weights (2-D `blk.*` tensors but norms) in that GGUF block type, by the `gguf` package's
    own quantizer, as `llama-quantize` would store them; the rest stays f32.

    Reads the saved safetensors (per-expert names, as the converter sees them), not a
    live transformers model. Gemma gets a sentencepiece vocabulary (Gemma's converter
    writes add_space_prefix false); DeepSeek gets the folder's byte-level BPE tokenizer.json.
    """
    from safetensors.torch import load_file

    c = config
    w = GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    if arch in ("gemma2", "gemma3"):
        _gemma_params(w, c, arch)
        tokens, scores, types = tiny_spm_vocab(c.vocab_size)
        add_spm_vocab(w, tokens, scores, types, bos=2, eos=1, unk=3, add_space_prefix=False)
        names = _GEMMA
    elif arch == "deepseek2":
        _deepseek_params(w, c, split_kv_b)
        add_gpt2_vocab_from_folder(w, folder, c.vocab_size)
        names = _DEEPSEEK
    else:
        raise ValueError(f"export_model does not write {arch!r}")
    sd = load_file(os.path.join(folder, "model.safetensors"))
    tensors = {**_global_tensors(sd, arch, c.tie_word_embeddings), **_layer_tensors(sd, names, c, arch, split_kv_b)}
    for name, arr in tensors.items():
        if quantize is not None and name.startswith("blk.") and arr.ndim == 2 and "norm" not in name:
            w.add_tensor(name, gguf_quantize(arr, quantize), raw_dtype=quantize)
        else:
            w.add_tensor(name, arr)
    _write(w)
    return path


def _write(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_metadata_only(path: str, arch: str, kv: dict[str, Any], tokenizer: dict[str, Any] | None = None) -> str:
    """A GGUF with metadata and no tensors: `kv` keys are `{arch}.`-relative (ints, floats, strs, bools)."""
    w = GGUFWriter(path, arch)
    for key, value in {**{f"{arch}.{k}": v for k, v in kv.items()}, **(tokenizer or {})}.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
    _write(w)
    return path


def write_spm_tokenizer_gguf(path: str, tokens: list[str], scores: list[float], types: list[int],
                             **vocab_kw: Any) -> str:
    """A vocabulary-only "llama" GGUF (llama.cpp's --vocab-only): hyper-parameters, no tensors."""
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(2)
    add_spm_vocab(w, tokens, scores, types, **vocab_kw)
    _write(w)
    return path
