"""Read a llama.cpp GGUF file into HF-named float32 weights, an HF-style config and a tokenizer.

GGUF stores what `convert_hf_to_gguf.py` wrote: llama.cpp tensor names
(`blk.0.attn_q.weight`), quantized blocks, and -- for the llama architecture --
q/k projection rows permuted from HF's "rotate half" rope layout into
llama.cpp's interleaved-pairs layout. We dequantize, rename and undo that
permutation so the rest of kvforge sees exactly what an HF checkpoint holds.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# llama.cpp tensor name (inside blk.N) -> HF module path (inside model.layers.N)
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
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp derives from config (Llama-3.1 rope frequencies); HF recomputes them.
_IGNORED = {"rope_freqs.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

# arch -> (model_type, HF class, whether q/k rows were permuted for rope)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
}


def field(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value (scalar, string or list), or `default` when the key is absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(x: float) -> float:
    """GGUF stores floats as f32; give back the short decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def gguf_hf_config(reader: Any) -> dict:
    """Synthesize the HF `config.json` dict this GGUF was converted from."""
    arch = field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHS)}")
    model_type, cls_name, _ = _ARCHS[arch]
    if arch == "llama" and "mistral" in str(field(reader, "general.name", "")).lower():
        model_type, cls_name = "mistral", "MistralForCausalLM"  # llama.cpp files Mistral under llama

    def meta(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    vocab = meta("vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [cls_name],
        "vocab_size": int(vocab),
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
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
        cfg["mlp_bias"] = False
    scaling = meta("rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": _f32(meta("rope.scaling.factor", 1.0))}
        orig = meta("rope.scaling.original_context_length")
        if orig:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    if "rope_freqs.weight" in names:
        logger.warning("GGUF has rope_freqs (Llama-3.1 rope scaling), which is not reconstructed")
    return cfg


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for ignorable tensors."""
    if gguf_name in _IGNORED:
        return None
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
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


def gguf_weights(reader: Any, cfg: dict) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 under its HF name, q/k rope rows un-permuted."""
    from gguf.quants import dequantize

    permuted = _ARCHS[field(reader, "general.architecture")][2]
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        arr = dequantize(t.data, t.tensor_type)
        if arr.dtype != np.float32 or not arr.flags.writeable:  # F32 tensors come back as file views
            arr = np.array(arr, dtype=np.float32)
        w = torch.from_numpy(arr)
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            w = unpermute_rope_rows(w, heads[proj])
        out[name] = w.contiguous()
    return out


# ---- tokenizer -------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char table (byte-level BPE spells tokens with it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None) -> Any:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (how text is split before BPE)."""
    from tokenizers import Regex, pre_tokenizers as pt

    if pre in _SPLITS:
        return pt.Sequence([pt.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":  # SmolLM's tokenizer.json: single digits, then GPT-2 byte-level
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre not in (None, "default", "gpt-2", "gpt2"):
        logger.warning("unknown tokenizer.ggml.pre %r; using GPT-2 byte-level splitting", pre)
    return pt.ByteLevel(add_prefix_space=False, use_regex=True)


def build_gguf_tokenizer(reader: Any) -> tuple[Any, dict]:
    """Build a byte-level BPE `tokenizers.Tokenizer` from GGUF metadata, plus its special-token facts."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {}
    for i, tok in enumerate(tokens):  # a few files store raw text; respell it in the byte alphabet
        vocab[tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode())] = i
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    # 3 = CONTROL (special, never split), 4 = USER_DEFINED (matched whole, but ordinary text).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == 4])
    eos = [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    meta = {
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_ids": [int(e) for e in eos if e is not None],
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": field(reader, "tokenizer.chat_template"),
    }
    return backend, meta
