"""Tiny random-weight models of each family, built with transformers' own config classes.

Saved as HF folders (config.json + model.safetensors + a byte-level tokenizer)
so kvforge loads them exactly as it would load a downloaded model, and
transformers runs the same weights as the correctness referee.
"""
from __future__ import annotations

import json
import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

VOCAB = 320  # 256 byte tokens + specials + spare ids
EOS_TEXT = "<|endoftext|>"


def write_byte_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer with no merges: every byte is a token; id 256 is EOS."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TEXT])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS_TEXT, "bos_token": None, "add_bos_token": False,
                   "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}<assistant>{% endif %}"}, f)


FAMILIES = {
    "llama_gqa": ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama_mha": ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 4}),
    "llama_mqa": ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 1}),
    "llama3_rope": ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
                                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama_untied": ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2_bias": ("Qwen2Config", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None}),
    # head size 64 with 3 query heads per KV head (as in SmolLM2): the CPU kernels' vector paths
    "llama_d64": ("LlamaConfig", {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1}),
    # issue 6: architectures that change what is cached
    "mistral_swa": ("MistralConfig", {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 12}),
    "mistral_swa_d64": ("MistralConfig", {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
                                          "sliding_window": 12}),
    "deepseek_v2": ("DeepseekV2Config", {"num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
                                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                         "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
                                         "num_experts_per_tok": 2, "first_k_dense_replace": 1}),
    "deepseek_v2_yarn": ("DeepseekV2Config", {"num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 24,
                                              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                              "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 2,
                                              "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                                              "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
                                              "routed_scaling_factor": 2.0,
                                              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                                  "factor": 4.0, "original_max_position_embeddings": 32,
                                                                  "mscale": 0.707, "mscale_all_dim": 0.707,
                                                                  "beta_fast": 32, "beta_slow": 1}}),
    # issue 14: QK-norm (Qwen3, head_dim set apart from hidden / heads) and a Qwen3 mixture of experts
    # (4 experts, top-2, normalised; layer 1 dense through mlp_only_layers)
    "qwen3": ("Qwen3Config", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                     "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    "gemma2": ("Gemma2Config", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
                                "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                                "final_logit_softcapping": 10.0, "num_hidden_layers": 3,
                                "tie_word_embeddings": False}),
    "gemma3": ("Gemma3TextConfig", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                    "sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 24,
                                    "num_hidden_layers": 3, "max_position_embeddings": 512,
                                    "tie_word_embeddings": False}),
    "gemma3_linear": ("Gemma3TextConfig", {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
                                           "sliding_window": 6, "sliding_window_pattern": 3, "num_hidden_layers": 3,
                                           "query_pre_attn_scalar": 16, "max_position_embeddings": 512,
                                           "rope_parameters": {
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                                           "tie_word_embeddings": False}),
}


def build_tiny_model(path: str, family: str = "llama_gqa", seed: int = 0, **overrides):
    """Save a tiny random model of `family` under `path`; returns the transformers model (fp32, eval)."""
    import transformers

    cls_name, kwargs = FAMILIES[family]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None, eos_token_id=256,
                pad_token_id=None)
    base.update(kwargs)
    base.update(overrides)
    cfg = getattr(transformers, cls_name)(**base)
    torch.manual_seed(seed)
    model_cls = transformers.AutoModelForCausalLM.from_config(cfg).__class__
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger-than-default weights so logits are far from uniform and ties are rare
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate for one prompt, with EOS ignored."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
