"""MLA (DeepSeek-V2/V3): latent cache, absorbed decode, and kvforge vs transformers.

The cache must hold one latent per token per layer (kv_lora_rank + rope dim) and
the engine must allocate exactly the ledger's bytes; absorbed decode must equal
the decompressing path; greedy tokens must equal transformers through every
scheduling path (batch, chunked prefill, preemption) for DeepSeek-V2 variants
(q_lora on/off, greedy / group-limited routing, YaRN) and DeepSeek-V3 routing.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.attention.metadata import AttentionMetadata, PrefillChunk
from kvforge.attention.mla import mla_attention
from kvforge.kv.storage.mla_latent import LatentKVCache
from kvforge.ledger import KVShape, kv_bytes_per_token
from tiny_models import hf_greedy

PROMPTS = [[5, 17, 99, 3, 8, 200, 45], list(range(10, 60)), [7], [i % 250 for i in range(31, 31 + 70)]]
NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

VARIANTS = ["deepseek_v2", "deepseek_v2_yarn"]  # q_lora off/on, greedy/group-limited routing, default/YaRN rope


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    """A tiny DeepSeek-V3 (sigmoid + e_score_correction_bias, noaux_tc, norm_topk_prob) with a non-zero bias."""
    import transformers

    from tiny_models import VOCAB, write_byte_tokenizer

    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=512,
        rope_interleave=True, bos_token_id=None, eos_token_id=256, pad_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    path = str(tmp_path_factory.mktemp("deepseek_v3"))
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return path, model


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")  # the transformers parity is in fp32 (auto: bf16 on bf16 CPUs)
    kw.setdefault("num_kv_blocks", 96)
    return LLM(model=path, log_ledger=False, **kw)


_REFS: dict[str, list[list[int]]] = {}


def _reference(path: str, hf) -> list[list[int]]:
    """transformers' greedy tokens for PROMPTS, computed once per model."""
    if path not in _REFS:
        _REFS[path] = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return _REFS[path]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", VARIANTS)
def test_deepseek_v2_greedy_and_logits_match_transformers(tiny_model_factory, family):
    path, hf = tiny_model_factory(family)
    llm = _llm(path)
    assert _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)) == _reference(path, hf)
    logits = llm.engine.prompt_logits(PROMPTS[3])
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[3]])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4
    assert_no_leaks(llm.engine)


def test_deepseek_v3_routing_matches_transformers(deepseek_v3):
    path, hf = deepseek_v3
    llm = _llm(path, max_num_batched_tokens=16)
    assert _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)) == _reference(path, hf)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0]
    assert (llm.engine.prompt_logits(PROMPTS[1]) - ref).abs().max().item() < 1e-4
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 14, "block_size": 8}, id="tiny-cache-preemption"),
        pytest.param({"attention_backend": "torch", "max_num_batched_tokens": 16}, id="reference-backend"),
    ],
)
def test_scheduling_paths_match_transformers(tiny_model_factory, engine_kwargs):
    path, hf = tiny_model_factory("deepseek_v2")
    llm = _llm(path, **engine_kwargs)
    assert _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)) == _reference(path, hf)
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert_no_leaks(llm.engine)


def test_engine_allocates_the_ledger_bytes_per_token(tiny_model_factory):
    """One latent (kv_lora_rank + rope dim) per token per layer: allocated bytes == ledger == hand count."""
    path, _ = tiny_model_factory("deepseek_v2")
    engine = _llm(path, num_kv_blocks=10, block_size=4).engine
    shape = engine.model_config.kv_shape()
    assert shape.is_mla and shape.mla_latent_dim == 32 + 8
    allocated = sum(c.nbytes for c in engine.runner.caches)
    per_token = allocated / (10 * 4)
    assert per_token == kv_bytes_per_token(shape, engine.cache_format, 4) == 2 * (32 + 8) * 4
    assert engine.report.kv_bytes_per_token == per_token and engine.report.kv_cache_bytes == allocated
    assert all(isinstance(c, LatentKVCache) for c in engine.runner.caches)
    mha = KVShape(2, 4, 16 + 8, v_head_dim=16)  # the same attention with per-head K and V cached
    assert kv_bytes_per_token(mha, "float32") / per_token == pytest.approx((4 * 24 + 4 * 16) / 40)


def _random_batch(cache: LatentKVCache, heads: int, gen: torch.Generator):
    """Fill a latent cache and build metadata: 3 decodes of different lengths, then 2 prefill chunks."""
    bs, r, dr = cache.block_size, cache.kv_lora_rank, cache.rope_dim
    cache.latent.copy_(torch.randn(cache.latent.shape, generator=gen))
    perm = torch.randperm(cache.num_blocks, generator=gen)
    tables = [perm[0:4], perm[4:7], perm[7:12]]
    dec_lens = torch.tensor([13, 9, 20])
    chunks = [PrefillChunk(slice(3, 8), 3, 8, perm[12:14]), PrefillChunk(slice(8, 14), 10, 16, perm[14:18])]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(14, dtype=torch.int64), num_decodes=3,
        decode_block_tables=torch.nn.utils.rnn.pad_sequence(tables, batch_first=True), decode_seq_lens=dec_lens,
        prefills=chunks,
    )
    q_nope, q_rope = torch.randn(14, heads, 16, generator=gen), torch.randn(14, heads, dr, generator=gen)
    return meta, q_nope, q_rope, r, bs


@pytest.mark.parametrize("backend", ["torch", "sdpa", "cpu"])
def test_absorbed_decode_equals_decompressed_and_naive(backend):
    gen = torch.Generator().manual_seed(0)
    heads, nope, v_dim = 4, 16, 12
    cache = LatentKVCache(24, 4, 32, 8, torch.float32)
    meta, q_nope, q_rope, r, bs = _random_batch(cache, heads, gen)
    meta.backend = backend
    w_uk, w_uv = torch.randn(heads, nope, r, generator=gen) * 0.2, torch.randn(heads, v_dim, r, generator=gen) * 0.2
    outs = {
        (d, p): mla_attention(q_nope, q_rope, cache, meta, w_uk, w_uv, 0.3, decode_path=d, prefill_path=p)
        for d in ("absorb", "decompress") for p in ("absorb", "decompress")
    }
    base = outs[("decompress", "decompress")]
    assert base.shape == (14, heads, v_dim)
    for out in outs.values():
        torch.testing.assert_close(out, base, atol=1e-5, rtol=1e-5)
    # naive: expand K/V per head for one decode row and one prefill row by hand
    latent = cache.latent.view(-1, r + 8)

    def naive(row: int, table: torch.Tensor, length: int) -> torch.Tensor:
        slots = (table[torch.arange(length) // bs] * bs + torch.arange(length) % bs)
        c, kr = latent[slots, :r], latent[slots, r:]
        k = torch.cat((torch.einsum("lr,hdr->hld", c, w_uk), kr[None].expand(heads, -1, -1)), -1)
        v = torch.einsum("lr,hdr->hld", c, w_uv)
        q = torch.cat((q_nope[row], q_rope[row]), -1)
        p = torch.softmax(torch.einsum("hd,hld->hl", q, k) * 0.3, -1)
        return torch.einsum("hl,hld->hd", p, v)

    torch.testing.assert_close(base[1], naive(1, meta.decode_block_tables[1], 9), atol=1e-5, rtol=1e-5)
    chunk = meta.prefills[1]  # row 8 is position 10 of that sequence: it sees 11 tokens
    torch.testing.assert_close(base[8], naive(8, chunk.block_table, 11), atol=1e-5, rtol=1e-5)


def test_absorbed_engine_equals_decompressing_engine(tiny_model_factory):
    path, _ = tiny_model_factory("deepseek_v2")
    results = {}
    for decode, prefill in (("absorb", "decompress"), ("decompress", "decompress"), ("absorb", "absorb")):
        llm = _llm(path)
        llm.engine.model.set_mla_paths(decode, prefill)
        results[decode, prefill] = _tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY))
        assert_no_leaks(llm.engine)
    assert len({str(v) for v in results.values()}) == 1


def test_latent_cache_roundtrip_and_refuses_kv_interface():
    cache = LatentKVCache(4, 2, 6, 2, torch.float32)
    c, kr = torch.randn(3, 6), torch.randn(3, 2)
    cache.write_latent(torch.tensor([7, 0, 3]), c, kr)
    got_c, got_r = cache.gather_latent(torch.tensor([[3, 0, 1]]))
    assert torch.equal(got_c[0, 1], c[0]) and torch.equal(got_r[0, 2], kr[1]) and torch.equal(got_c[0, 5], c[2])
    cache.copy_blocks([(3, 2)])
    assert torch.equal(cache.latent[2], cache.latent[3])
    assert cache.nbytes == 4 * 2 * 8 * 4
    assert not hasattr(cache, "write") and not hasattr(cache, "gather")  # no K/V to store: latents only
    with pytest.raises(ValueError, match="kv_lora_rank"):
        LatentKVCache(4, 2, 0, 2, torch.float32)


def test_checkpoint_mismatch_is_a_value_error(tiny_model_factory):
    from kvforge.config import ModelConfig
    from kvforge.models.loader import load_checkpoint
    from kvforge.models.registry import build_model

    ckpt = load_checkpoint(tiny_model_factory("deepseek_v2")[0])
    model = build_model(ModelConfig.from_hf(ckpt.hf_config))
    weights = dict(ckpt.weights)
    extra = {"model.layers.2.self_attn.kv_b_proj.weight": torch.zeros(1)}  # an MTP layer: ignored
    model.load_weights({**weights, **extra})
    del weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    with pytest.raises(ValueError, match="experts.3.down_proj"):
        model.load_weights(weights)


def test_half_precision_latent_cache_under_an_fp32_model(tiny_model_factory):
    """kv_cache_dtype=float16 halves the latent bytes; attention reads it back in the model's dtype."""
    path, hf = tiny_model_factory("deepseek_v2")
    engine = _llm(path, num_kv_blocks=16, kv_cache_dtype="float16").engine
    assert sum(c.nbytes for c in engine.runner.caches) == 16 * 16 * 2 * (32 + 8) * 2
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0]
    assert (engine.prompt_logits(PROMPTS[1]) - ref).abs().max().item() < 2e-2
    assert_no_leaks(engine)
