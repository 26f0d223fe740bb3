"""The KV ledger and the HF-config reader, against hand-computed numbers.

Every expected value below is written out as the arithmetic that produces it, so a
reader can check it without running anything.
"""
from __future__ import annotations

import pytest

from kvforge import ledger
from kvforge.ledger import KVCacheFormat, KVShape
from kvforge.planner import arch
from kvforge.planner.presets import PRESETS

KiB, MiB, GiB = 1024, 1024**2, 1024**3
LLAMA3_8B = KVShape(32, 8, 128)  # 32 layers, 8 KV heads, head_dim 128
FP16 = KVCacheFormat.uniform("float16")


# ---- MHA / GQA / MQA -------------------------------------------------------------------------

def test_llama3_8b_fp16_table_from_the_issue():
    assert ledger.kv_bytes_per_token_per_layer(LLAMA3_8B, FP16) == 2 * 8 * 128 * 2 == 4 * KiB
    assert ledger.kv_bytes_per_token(LLAMA3_8B, FP16) == 32 * 4 * KiB == 128 * KiB
    assert ledger.kv_bytes_per_block(LLAMA3_8B, 16, FP16) == 16 * 128 * KiB == 2 * MiB
    assert ledger.kv_bytes_for_sequence(LLAMA3_8B, 4096, FP16) == 4096 * 128 * KiB == 512 * MiB
    assert 32 * ledger.kv_bytes_for_sequence(LLAMA3_8B, 4096, FP16) == 16 * GiB


def test_mha_is_four_times_gqa_and_mqa_an_eighth():
    mha, mqa = KVShape(32, 32, 128), KVShape(32, 1, 128)
    assert ledger.kv_bytes_per_token(mha, FP16) == 2 * 32 * 32 * 128 * 2 == 512 * KiB
    assert ledger.kv_bytes_per_token(mha, FP16) == 4 * ledger.kv_bytes_per_token(LLAMA3_8B, FP16)
    assert ledger.kv_bytes_per_token(mqa, FP16) == 2 * 32 * 1 * 128 * 2 == 16 * KiB


def test_v_head_dim_differs_from_k():
    shape = KVShape(2, 4, 192, v_head_dim=128)
    assert ledger.kv_bytes_per_token_per_layer(shape, FP16) == 4 * 192 * 2 + 4 * 128 * 2


# ---- MLA -------------------------------------------------------------------------------------

def test_deepseek_v2_mla_latent_no_factor_two():
    shape = arch.kv_shape_from_hf(PRESETS["deepseek-v2"])
    assert shape.is_mla and shape.mla_latent_dim == 512 + 64
    assert ledger.kv_bytes_per_token_per_layer(shape, "bfloat16") == (512 + 64) * 2 == 1152
    assert ledger.kv_bytes_per_token(shape, "bfloat16") == (512 + 64) * 2 * 60 == 69_120
    # fp8 with one float32 scale per token per layer: the latent is one tensor, so one scale
    assert ledger.kv_bytes_per_token(shape, KVCacheFormat.uniform("fp8")) == (576 * 1 + 4) * 60


# ---- quantized formats and their scales ------------------------------------------------------

@pytest.mark.parametrize(
    "fmt, per_layer",
    [
        (KVCacheFormat.uniform("fp8"), 2 * 8 * 128 * 1 + 2 * 4),  # per token: one scale for K, one for V
        (KVCacheFormat.uniform("fp8", "tensor"), 2 * 8 * 128),  # static scale: free per token
        (KVCacheFormat.uniform("int8", "head"), 2 * 8 * 128 + 2 * 8 * 4),  # one scale per head
        # K: one scale per channel per block, amortised; V falls back to per-token scales (KIVI)
        (KVCacheFormat.uniform("int8", "channel"), 2 * 8 * 128 + 8 * 128 * 4 / 16 + 4),
        (KVCacheFormat.uniform("int4"), 2 * 8 * 128 * 0.5 + 2 * 4),
        (KVCacheFormat("fp8", "float16", "token"), 8 * 128 * 1 + 4 + 8 * 128 * 2),  # K and V apart
        (KVCacheFormat("float16", "float16", "token"), 2 * 8 * 128 * 2),  # unquantized: scales ignored
    ],
)
def test_quantized_formats_include_scale_bytes(fmt, per_layer):
    assert ledger.kv_bytes_per_token_per_layer(LLAMA3_8B, fmt, block_size=16) == per_layer


def test_uniform_keeps_old_keyword_and_defaults_quantized_to_token_scales():
    assert KVCacheFormat.uniform("int8").scale_granularity == "token"
    assert KVCacheFormat.uniform("int8", scale_granularity="head").scale_granularity == "head"
    assert KVCacheFormat.uniform("bfloat16").scale_granularity is None


# ---- sliding windows -------------------------------------------------------------------------

def test_sliding_window_layers_hold_at_most_window_tokens():
    mistral = arch.kv_shape_from_hf(PRESETS["mistral-7b"])
    assert mistral.sliding_windows == (4096,) * 32
    assert ledger.kv_bytes_for_sequence(mistral, 32768, FP16) == 4096 * 128 * KiB
    assert ledger.kv_bytes_for_sequence(mistral, 1000, FP16) == 1000 * 128 * KiB
    # per token (what every new token costs while the window fills) ignores windows
    assert ledger.kv_bytes_per_token(mistral, FP16) == 128 * KiB


def test_gemma2_alternates_local_and_global_layers():
    shape = arch.kv_shape_from_hf(PRESETS["gemma-2-9b"])
    assert shape.sliding_windows[:4] == (4096, None, 4096, None)
    per_layer = 2 * 8 * 256 * 2  # 8 KiB
    assert ledger.kv_bytes_for_sequence(shape, 32768, FP16) == 21 * per_layer * 4096 + 21 * per_layer * 32768


def test_paged_bytes_round_each_layer_to_blocks():
    assert ledger.kv_bytes_for_sequence_paged(LLAMA3_8B, 4097, FP16, 16) == 257 * 2 * MiB
    windowed = KVShape(2, 1, 4, sliding_windows=(20, None))  # 16 B per token per layer in fp16
    # layer 0 holds 20 tokens -> 2 blocks; layer 1 holds 100 -> 7 blocks; block = 16 tokens x 16 B
    assert ledger.kv_bytes_for_sequence_paged(windowed, 100, FP16, 16) == (2 + 7) * 16 * 16


# ---- capacity --------------------------------------------------------------------------------

def test_blocks_and_concurrency_agree_with_the_block_pool():
    assert ledger.num_blocks_for_memory(80 * GiB, LLAMA3_8B, 16, FP16) == 80 * GiB // (2 * MiB) == 40960
    # the pool's null block takes one of the 8192 blocks 16 GiB buys: 31 sequences of 256 blocks, 32 with one more
    assert ledger.max_concurrency(16 * GiB, LLAMA3_8B, 4096, FP16) == 31
    assert ledger.max_concurrency(16 * GiB + 2 * MiB, LLAMA3_8B, 4096, FP16) == 32
    windowed = KVShape(32, 8, 128, sliding_windows=(4096,) * 32)
    assert ledger.max_concurrency(16 * GiB, windowed, 32768, FP16) == 32  # capped at the window


def test_kv_memory_budget_subtracts_weights_and_activations():
    assert ledger.kv_memory_budget(80 * GiB, 0.9, 16 * GiB, 1 * GiB) == 72 * GiB - 17 * GiB
    with pytest.raises(ValueError, match="smaller than the weights"):
        ledger.kv_memory_budget(16 * GiB, 0.9, 16 * GiB)
    with pytest.raises(ValueError, match="leave no KV memory"):
        ledger.kv_memory_budget(20 * GiB, 1.0, 16 * GiB, 4 * GiB)
    with pytest.raises(ValueError, match="memory_utilization"):
        ledger.kv_memory_budget(80 * GiB, 1.5, 0)


# ---- parsing, formatting, validation ---------------------------------------------------------

@pytest.mark.parametrize("text, n", [("2GiB", 2 * GiB), ("512MB", 512_000_000), ("1.5e9", 1_500_000_000),
                                     (1000, 1000), (" 4 kib ", 4096), ("80GB", 80_000_000_000)])
def test_parse_bytes(text, n):
    assert ledger.parse_bytes(text) == n


@pytest.mark.parametrize("text, msg", [("-5GiB", "--gpu-memory must be >= 0"), ("lots", "cannot parse"),
                                       ("5XB", "cannot parse")])
def test_parse_bytes_rejects_bad_sizes_naming_the_field(text, msg):
    with pytest.raises(ValueError, match=msg):
        ledger.parse_bytes(text, "--gpu-memory")


def test_format_bytes_binary_units():
    assert ledger.format_bytes(512) == "512 B"
    assert ledger.format_bytes(4 * KiB) == "4.00 KiB"
    assert ledger.format_bytes(16 * GiB) == "16.00 GiB"
    assert ledger.format_bytes(3 * 1024 * GiB) == "3.00 TiB"


@pytest.mark.parametrize("kwargs", [dict(num_layers=0, num_kv_heads=8, head_dim=128),
                                    dict(num_layers=2, num_kv_heads=8, head_dim=128, sliding_windows=(4,)),
                                    dict(num_layers=1, num_kv_heads=8, head_dim=128, sliding_windows=(-4,))])
def test_kvshape_rejects_impossible_shapes(kwargs):
    with pytest.raises(ValueError):
        KVShape(**kwargs)


def test_kv_format_rejects_unknown_dtype_and_granularity():
    with pytest.raises(ValueError, match="not supported"):
        KVCacheFormat.uniform("int3")
    with pytest.raises(ValueError, match="scale_granularity"):
        KVCacheFormat("int8", "int8", "row")


# ---- HF config -> KVShape and parameter count ------------------------------------------------

def _llama(**kw):
    return {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 100, **kw}


def test_missing_kv_heads_reads_as_mha():
    cfg = _llama()
    del cfg["num_key_value_heads"]
    assert arch.kv_shape_from_hf(cfg) == KVShape(4, 8, 8)
    assert arch.attention_kind(cfg) == "MHA" and arch.attention_kind(_llama(num_key_value_heads=1)) == "MQA"


def test_qwen2_window_needs_use_sliding_window_and_starts_at_max_window_layers():
    cfg = _llama(model_type="qwen2", sliding_window=32, max_window_layers=3)
    assert arch.kv_shape_from_hf(cfg).sliding_windows == ()
    on = arch.kv_shape_from_hf({**cfg, "use_sliding_window": True})
    assert on.sliding_windows == (None, None, None, 32)  # transformers: index >= max_window_layers slides


def test_gemma3_pattern_and_explicit_layer_types():
    g3 = arch.kv_shape_from_hf(_llama(model_type="gemma3_text", num_hidden_layers=12, sliding_window=512))
    assert g3.sliding_windows == (512,) * 5 + (None,) + (512,) * 5 + (None,)
    nested = {"model_type": "gemma3", "text_config": _llama(model_type="gemma3_text", sliding_window=8,
                                                            sliding_window_pattern=2)}
    assert arch.kv_shape_from_hf(nested).sliding_windows == (8, None, 8, None)
    kinds = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert arch.kv_shape_from_hf(_llama(sliding_window=16, layer_types=kinds)).sliding_windows == (None, 16, None, 16)


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        arch.kv_shape_from_hf({"hidden_size": 64, "num_attention_heads": 8})
    with pytest.raises(ValueError, match="'num_attention_heads' must be a positive integer"):
        arch.kv_shape_from_hf(_llama(num_attention_heads=-8, num_key_value_heads=None))


def test_param_count_tiny_llama_by_hand():
    # embed 100x64 (x2 untied) + final norm 64; per layer: q 64x64, k,v 64x16 each, o 64x64,
    # mlp 3x64x128, norms 2x64
    per_layer = 64 * 64 + 2 * 64 * 16 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert arch.param_count(_llama()) == 2 * 100 * 64 + 64 + 4 * per_layer
    assert arch.param_count(_llama(tie_word_embeddings=True)) == 100 * 64 + 64 + 4 * per_layer


@pytest.mark.parametrize("preset, params", [
    ("llama-3-8b", 8_030_261_248), ("llama-2-7b", 6_738_415_616), ("mistral-7b", 7_241_732_096),
    ("qwen2.5-7b", 7_615_616_512), ("gemma-2-9b", 9_241_705_984), ("smollm2-135m", 134_515_008),
])
def test_preset_param_counts_match_published_sizes(preset, params):
    assert arch.param_count(PRESETS[preset]) == params


def test_deepseek_v2_is_236b():
    assert 235.5e9 < arch.param_count(PRESETS["deepseek-v2"]) < 236.5e9


def test_param_count_matches_transformers_for_each_family():
    """Instantiate tiny models on the meta device and count their real parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=97)
    configs = [
        transformers.LlamaConfig(num_key_value_heads=2, **common),
        transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
        transformers.MistralConfig(num_key_value_heads=1, sliding_window=16, **common),
        transformers.Gemma2Config(num_key_value_heads=2, head_dim=32, **common),
        transformers.DeepseekV2Config(**{**common, "num_hidden_layers": 3}, kv_lora_rank=16, q_lora_rank=24,
                                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                      n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                                      first_k_dense_replace=1, num_key_value_heads=4),
    ]
    for cfg in configs:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        expected = sum(p.numel() for p in model.parameters())
        assert arch.param_count(cfg.to_dict()) == expected, cfg.model_type
