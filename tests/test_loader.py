"""The loader must hand the engine exactly the model transformers would build.

GGUF: our dequantized, renamed, rope-unpermuted weights in a transformers
Llama must give transformers-from-GGUF's logits; our tokenizer its ids.
HF folder: a saved tiny random Llama round-trips. Bad paths fail loudly.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvforge.models.gguf_loader import _LAYER_NAMES, hf_tensor_name, unpermute_rope_rows
from kvforge.gguf_tokenizer import _byte_alphabet
from kvforge.models.loader import DEFAULT_MODEL_NAME, Checkpoint, default_model_path, load_checkpoint

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! The quick brown fox.",
    "héllo wörld, ça va? 世界 こんにちは",
    "emoji 🤗🎉👍🏽 done",
    "def f(x):\n    return x * 2  # 1234567\n",
    "  leading\t\ttabs\n\n\n   trailing   ",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def ckpt() -> Checkpoint:
    return load_checkpoint(None)


def test_default_checkpoint_shape(ckpt: Checkpoint) -> None:
    cfg = ckpt.hf_config
    assert ckpt.path == default_model_path() and ckpt.path.endswith(".gguf")
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", 30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in ckpt.weights
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert all(w.dtype == torch.float32 for w in ckpt.weights.values())
    assert ckpt.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ckpt.weights["model.embed_tokens.weight"].shape == (49152, 576)


def test_reading_one_gguf_tensor_converts_only_that_tensor(ckpt: Checkpoint, monkeypatch) -> None:
    """`weights[name]` dequantizes the file tensor(s) `name` comes from, not every q/k/norm tensor on the way
    (reading each weight once was quadratic: 26 s for the default model's 135 M weights, now under 1 s)."""
    from kvforge.models import gguf_loader

    seen: list[str] = []
    real = gguf_loader._dequantized
    monkeypatch.setattr(gguf_loader, "_dequantized", lambda t, *a: seen.append(t.name) or real(t, *a))
    for name, gguf_name in [("model.layers.3.self_attn.q_proj.weight", "blk.3.attn_q.weight"),
                            ("model.layers.5.input_layernorm.weight", "blk.5.attn_norm.weight"),
                            ("model.layers.7.mlp.down_proj.weight", "blk.7.ffn_down.weight")]:
        seen.clear()
        w = ckpt.weights[name]
        assert set(seen) == {gguf_name} and w.shape == ckpt.weights.source.shapes[name]


def test_gguf_logits_match_transformers(ckpt: Checkpoint, reference_model) -> None:
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ckpt.hf_config))
    missing, unexpected = ours.load_state_dict(ckpt.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ours.tie_weights()
    ids = torch.tensor([ckpt.tokenizer.encode("The capital of France is Paris. The capital of Italy is")])
    with torch.no_grad():
        got, want = ours.eval()(ids).logits, reference_model(ids).logits
    assert (got - want).abs().max().item() < 1e-4
    assert got[0, -1].argmax() == want[0, -1].argmax()


def test_rope_unpermute_is_needed(ckpt: Checkpoint, reference_model) -> None:
    """Guard against a vacuous pass: the raw (permuted) q rows differ from the HF layout."""
    q = ckpt.weights["model.layers.0.self_attn.q_proj.weight"]
    ref = reference_model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q, ref)
    permuted = q.reshape(9, 2, 32, 576).transpose(1, 2).reshape(q.shape)  # llama.cpp's forward permute
    assert not torch.equal(permuted, ref)
    assert torch.equal(unpermute_rope_rows(permuted, 9), q)


def test_gguf_tokenizer_matches_transformers(ckpt: Checkpoint) -> None:
    path = default_model_path()
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = ckpt.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.id_to_token(2) == "<|im_end|>"


def test_tensor_names() -> None:
    assert hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        hf_tensor_name("blk.0.ssm_a.weight")


def test_hf_folder_round_trip(tmp_path, ckpt: Checkpoint) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=ckpt.tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    ckpt.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True,
        "chat_template": ckpt.tokenizer.chat_template,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    loaded = load_checkpoint(str(tmp_path))
    assert loaded.hf_config["num_hidden_layers"] == 2 and loaded.path == str(tmp_path)
    want = model.state_dict()
    assert set(loaded.weights) == set(want)
    assert all(torch.equal(loaded.weights[k], want[k]) for k in want)
    tok = loaded.tokenizer
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id == 1
    assert tok.encode("hi") == [1, *ckpt.tokenizer.encode("hi")]  # add_bos_token honoured
    assert tok.encode("hi", add_special_tokens=False) == ckpt.tokenizer.encode("hi")
    assert tok.has_chat_template


def test_sharded_and_tied_folder(tmp_path, ckpt: Checkpoint) -> None:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ckpt.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_checkpoint(str(tmp_path))
    assert "lm_head.weight" not in loaded.weights
    assert torch.equal(loaded.weights["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert not loaded.tokenizer.has_chat_template


def test_bad_paths(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(missing)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(str(tmp_path))
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"xx")
    with pytest.raises(ValueError, match="weights.bin"):
        load_checkpoint(str(txt))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="fake.gguf"):
        load_checkpoint(str(fake))


def test_default_name_resolves() -> None:
    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"


def _write_gguf(path, arch: str, model, permute: bool) -> None:
    """Write an HF model as llama.cpp would (names, f32 tensors, rope-permuted q/k for llama)."""
    import numpy as np
    from gguf import GGUFWriter

    c = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters") else c.rope_theta)
    tokens = ["<|endoftext|>", *_byte_alphabet().values()]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * 256)
    w.add_token_merges([])
    w.add_eos_token_id(0)
    names = {v: k for k, v in {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                               "output": "lm_head"}.items()}
    for hf, t in model.state_dict().items():
        a = t.detach().numpy().astype(np.float32)
        base, kind = hf.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, i, rest = base.split(".", 3)
            gg = {v: k for k, v in _LAYER_NAMES.items()}[rest]
            if permute and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                n = c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads
                a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
            w.add_tensor(f"blk.{i}.{gg}.{kind}", np.ascontiguousarray(a))
        else:
            w.add_tensor(f"{names[base]}.{kind}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_gguf_round_trip(tmp_path, arch: str) -> None:
    """Tiny random models written as GGUF: llama with q/k biases (permuted too), qwen2 (biases, no permute)."""
    torch.manual_seed(0)
    common = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=True, **common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # non-zero biases so a wrong bias permutation would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, model.eval(), permute=arch == "llama")
    ck = load_checkpoint(str(path))
    assert ck.hf_config["model_type"] == arch and not ck.hf_config["tie_word_embeddings"]
    want = model.state_dict()
    assert set(ck.weights) == set(want)
    for k in want:
        assert torch.equal(ck.weights[k], want[k]), k
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    cfg_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    ours = cls(cfg_cls(**ck.hf_config))
    ours.load_state_dict(ck.weights)
    ids = torch.tensor([ck.tokenizer.encode("héllo 🤗")])
    with torch.no_grad():
        assert torch.allclose(ours.eval()(ids).logits, model(ids).logits, atol=1e-5)
    assert ck.tokenizer.decode(ids[0].tolist()) == "héllo 🤗"
