"""MLA vs MHA: KV bytes per token and how many more sequences fit in the same cache memory.

Builds two tiny random-weight models with transformers' config classes (CPU, seconds):
a DeepSeek-V2-shaped model (MLA + MoE) and its MHA twin of the same hidden size and
head count (Llama). Each runs in a kvforge engine given the same KV-cache memory; the
table reports the bytes per token the engine really allocated (== the ledger), the
blocks that fit, the sequences of `--seq-len` tokens the ledger says fit, and the peak
number of requests the scheduler actually ran at once when flooded with such requests.
Real-size rows (DeepSeek-V2 vs an MHA of its head shape) come from the ledger alone.

    python benchmarks/mla_vs_mha.py [--kv-cache-memory 8MiB] [--seq-len 256] [--requests 96]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from kvforge import LLM, SamplingParams  # noqa: E402
from kvforge.ledger import KVShape, format_bytes, kv_bytes_per_token, max_concurrency, parse_bytes  # noqa: E402

HIDDEN, HEADS, LAYERS = 512, 16, 4
TINY = {
    "MLA (DeepSeek-V2-shaped)": ("DeepseekV2Config", dict(
        kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
        first_k_dense_replace=1)),
    "MHA twin (Llama)": ("LlamaConfig", dict(num_key_value_heads=HEADS)),
}


def build(path: str, cls_name: str, extra: dict) -> None:
    import transformers

    from tiny_models import VOCAB, write_byte_tokenizer

    cfg = getattr(transformers, cls_name)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=4096, bos_token_id=None, eos_token_id=256,
        pad_token_id=None, tie_word_embeddings=True, **extra,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    write_byte_tokenizer(path)


def peak_running(llm: LLM, n: int, seq_len: int) -> int:
    """Flood the engine with n requests of seq_len tokens; the most it ran at once (blocks decide)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(n):
        engine.add_request(prompt_token_ids=[(i * 7 + j) % 250 for j in range(seq_len - 8)], params=params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    engine.check_integrity()
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-memory", default="8MiB")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--requests", type=int, default=96)
    args = ap.parse_args()
    memory = parse_bytes(args.kv_cache_memory, "kv-cache-memory")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cls_name, extra) in TINY.items():
            path = os.path.join(tmp, cls_name)
            build(path, cls_name, extra)
            llm = LLM(model=path, log_ledger=False, kv_cache_memory=memory, max_num_seqs=512,
                      max_num_batched_tokens=args.requests * args.seq_len, enable_prefix_caching=False)
            e = llm.engine
            shape = e.model_config.kv_shape()
            allocated = sum(c.nbytes for c in e.runner.caches)
            per_token = allocated / (e.pool.num_blocks * e.kv.block_size)
            assert per_token == kv_bytes_per_token(shape, e.cache_format, e.kv.block_size)
            fit = max_concurrency(memory, shape, args.seq_len, e.cache_format, e.kv.block_size)
            rows.append((name, per_token, e.pool.num_blocks, fit, peak_running(llm, args.requests, args.seq_len)))
    print(f"tiny models: hidden {HIDDEN}, {HEADS} heads, {LAYERS} layers, fp32; KV cache {format_bytes(memory)}, "
          f"block 16, sequences of {args.seq_len} tokens, {args.requests} requests offered")
    print(f"{'model':<26} {'KV B/token':>10} {'blocks':>7} {'fit (ledger)':>12} {'peak running':>13}")
    for name, per_token, blocks, fit, peak in rows:
        print(f"{name:<26} {per_token:>10.0f} {blocks:>7} {fit:>12} {peak:>13}")
    (_, mla_b, _, mla_fit, mla_peak), (_, mha_b, _, mha_fit, mha_peak) = rows
    print(f"MLA caches {mha_b / mla_b:.2f}x fewer bytes per token ({1 - mla_b / mha_b:.1%} less); "
          f"{mla_fit / max(mha_fit, 1):.2f}x the sequences fit (ledger), {mla_peak / max(mha_peak, 1):.2f}x ran at once")
    real_mla = KVShape(60, 1, 576, mla_latent_dim=576)  # DeepSeek-V2: kv_lora_rank 512 + rope 64
    real_mha = KVShape(60, 128, 192, v_head_dim=128)  # the same 128 heads caching K (nope+rope) and V per head
    a, b = kv_bytes_per_token(real_mla, "bfloat16"), kv_bytes_per_token(real_mha, "bfloat16")
    print(f"real size (ledger, bf16): DeepSeek-V2 MLA {format_bytes(a)}/token vs MHA of its heads "
          f"{format_bytes(b)}/token: {b / a:.1f}x; sequences of 4096 in 80 GiB: "
          f"{max_concurrency(80 << 30, real_mla, 4096, 'bfloat16')} vs {max_concurrency(80 << 30, real_mha, 4096, 'bfloat16')}")


if __name__ == "__main__":
    main()
