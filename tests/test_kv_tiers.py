"""KV tiers (host memory and disk below the block pool): bytes, files, and the engine with tiers on.

Block bytes survive device -> host -> disk -> device bit-exactly for every cache layout;
a flipped, truncated, foreign or re-salted file is a miss (and a bad file is deleted);
greedy outputs with tiers on equal outputs with tiers off on every scheduling path,
and after a restart on the same directory; bad flags exit 2 naming the flag.
"""
from __future__ import annotations

import os
import pytest
import torch

from conftest import assert_no_leaks
from kvforge import LLM, SamplingParams
from kvforge.kv.storage.dense import DenseKVCache
from kvforge.kv.storage.mla_latent import LatentKVCache
from kvforge.kv.storage.quantized import QuantizedKVCache
from kvforge.kv.tiers.block_io import BlockMover, block_tensors
from kvforge.kv.tiers.disk import DiskTier
from kvforge.kv.tiers.host import HostTier
from kvforge.kv.tiers.keys import tier_key

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHARED = [(7 * i + 3) % 250 for i in range(18)]
PROMPTS = [SHARED + [(11 * i + 5 * j) % 250 for i in range(6)] for j in range(4)]  # 6 blocks of 4, 4.5 shared


def _fill_random(cache) -> None:
    gen = torch.Generator().manual_seed(0)
    for t in block_tensors(cache):
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        else:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


LAYOUTS = {
    "dense-fp32": lambda n: DenseKVCache(n, 4, 2, 8, 8, torch.float32),
    "dense-bf16": lambda n: DenseKVCache(n, 4, 2, 8, 8, torch.bfloat16),
    "int8-token": lambda n: QuantizedKVCache(n, 4, 2, 8, 8, "int8", "int8", "token", torch.float32),
    "int4-channel": lambda n: QuantizedKVCache(n, 4, 2, 8, 8, "int4", "int4", "channel", torch.float32),
    "fp8-k-dense-v": lambda n: QuantizedKVCache(n, 4, 2, 8, 8, "fp8_e4m3", "float16", "head", torch.float32),
    "mla-latent": lambda n: LatentKVCache(n, 4, 16, 8, torch.float32),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_bytes_survive_device_host_disk_device(layout, tmp_path):
    src = [LAYOUTS[layout](6) for _ in range(2)]  # two layers
    for c in src:
        _fill_random(c)
    dst = [LAYOUTS[layout](6) for _ in range(2)]
    mover, back = BlockMover(src), BlockMover(dst)
    assert mover.block_nbytes == back.block_nbytes
    ids, tokens = [1, 4, 5], [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    keys = [tier_key(b"ns", bytes([i]) * 32) for i in range(3)]
    host = HostTier(10 * mover.block_nbytes, mover.block_nbytes)
    host.put_rows(list(zip(keys, tokens)), mover.export(ids))
    slots = [host.lookup(k, t) for k, t in zip(keys, tokens)]
    disk = DiskTier(str(tmp_path), 1 << 20, b"ns", background=False)
    for k, t, row in zip(keys, tokens, host.read(slots)):
        disk.put(k, t, row.numpy().tobytes())
    payloads = [DiskTier(str(tmp_path), 1 << 20, b"ns").get(k, t) for k, t in zip(keys, tokens)]  # a new process
    back.import_bytes([0, 2, 3], payloads)
    for s, d in zip(src, dst):
        for ts, td in zip(block_tensors(s), block_tensors(d)):
            for i, j in zip(ids, [0, 2, 3]):
                assert torch.equal(ts[i].view(torch.uint8), td[j].view(torch.uint8)), layout
    if layout.startswith(("int", "fp8")):  # codes and scales travel together: smaller than the dense block
        assert mover.block_nbytes < BlockMover([DenseKVCache(1, 4, 2, 8, 8, torch.float32)] * 2).block_nbytes


def _one_file(tmp_path, namespace=b"ns"):
    disk = DiskTier(str(tmp_path), 1 << 20, namespace, background=False)
    key = tier_key(namespace, b"h" * 32)
    disk.put(key, (1, 2, 3, 4), bytes(range(200)))
    return disk, key, disk.path(key)


@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "empty", "wrong-tokens"])
def test_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage):
    disk, key, path = _one_file(tmp_path)
    assert disk.get(key, (1, 2, 3, 4)) == bytes(range(200))
    blob = bytearray(open(path, "rb").read())
    if damage == "flip-payload":
        blob[-7] ^= 0x10
    elif damage == "flip-header":
        blob[30] ^= 0x01
    elif damage == "truncate":
        blob = blob[:-50]
    elif damage == "empty":
        blob = bytearray()
    with open(path, "wb") as f:
        f.write(blob)
    tokens = (1, 2, 3, 5) if damage == "wrong-tokens" else (1, 2, 3, 4)
    assert disk.get(key, tokens) is None
    assert not os.path.exists(path)
    assert disk.get(key, (1, 2, 3, 4)) is None


def test_foreign_namespace_file_is_a_miss(tmp_path):
    theirs, key, path = _one_file(tmp_path, b"model-a")
    mine = DiskTier(str(tmp_path), 1 << 20, b"model-b", background=False)
    assert mine.get(tier_key(b"model-b", b"h" * 32), (1, 2, 3, 4)) is None  # another address altogether
    assert mine.get(key, (1, 2, 3, 4)) is None  # even at its exact path: the header names model-a
    assert not os.path.exists(path)


def test_disk_size_bound_evicts_least_recently_used(tmp_path):
    keys = [tier_key(b"ns", bytes([i]) * 32) for i in range(6)]
    size = os.path.getsize(_one_file(tmp_path / "probe")[2]) - 200 + 300  # a file of a 300-byte payload
    limit = 3 * size + 10
    disk = DiskTier(str(tmp_path / "d"), limit, b"ns", background=False)
    for i, k in enumerate(keys):
        disk.put(k, (i,), bytes(300))
        if i >= 1:
            assert disk.get(keys[0], (0,)) is not None  # keep the first one hot
        assert disk.used <= limit
    assert disk.get(keys[0], (0,)) is not None and disk.get(keys[1], (1,)) is None
    files = [f for _, _, fs in os.walk(tmp_path / "d") for f in fs if f.endswith(".kvb")]
    assert len(files) == len(disk.index) == 3
    assert sum(os.path.getsize(disk.path(k)) for k in disk.index.entries) <= limit
    reopened = DiskTier(str(tmp_path / "d"), limit, b"ns", background=False)  # a restart keeps what fits
    assert reopened.used == disk.used and reopened.get(keys[0], (0,)) is not None


def _llm(path, **kw):
    kw.setdefault("dtype", "float32")  # the transformers parity is in fp32 (auto: bf16 on bf16 CPUs)
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 12)  # a request needs 8: the pool keeps little between requests
    return LLM(model=path, log_ledger=False, **kw)


def _run_twice(llm, params=GREEDY, prompts=PROMPTS):
    first = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    second = llm.generate(prompt_token_ids=prompts[::-1], sampling_params=params)[::-1]
    return [[c.token_ids for c in o.outputs] for o in first + second], first + second


@pytest.mark.parametrize(
    "family,kw,tiers",
    [
        pytest.param("llama_gqa", {}, "disk", id="dense-disk-only"),
        # host+disk on a plain model is covered by chunked-prefill and int8; recompute preemption by test_scheduler
        pytest.param("llama_gqa", {"max_num_batched_tokens": 7}, "host+disk", id="chunked-prefill"),
        pytest.param("llama_gqa", {"num_kv_blocks": 10, "preemption_mode": "swap"}, "host", id="preemption-swap"),
        pytest.param("llama_gqa", {"kv_cache_dtype": "int8"}, "host+disk", id="int8"),
        pytest.param("deepseek_v2", {}, "disk", id="mla"),
    ],
)
def test_greedy_outputs_identical_with_tiers_on_and_off(tiny_model_factory, tmp_path, family, kw, tiers):
    path, _ = tiny_model_factory(family)
    want, _ = _run_twice(_llm(path, **kw))
    tier_kw = {}
    if "host" in tiers:
        tier_kw["kv_offload_memory"] = "256KiB"
    if "disk" in tiers:
        tier_kw["kv_disk_cache"] = str(tmp_path / "kv")
    llm = _llm(path, **kw, **tier_kw)
    got, outs = _run_twice(llm)
    assert got == want
    stats = llm.tier_stats()
    assert sum(s["hit_tokens"] for s in stats.values()) > 0, "the small pool should send hits to the tiers"
    assert sum(o.num_cached_tokens_by_tier.get(t, 0) for o in outs for t in stats) > 0
    for o in outs:
        assert sum(o.num_cached_tokens_by_tier.values()) == o.num_cached_tokens
    if kw.get("num_kv_blocks") == 10:
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool should force preemption"
    if kw.get("preemption_mode") == "swap":
        assert llm.engine.scheduler.num_swaps > 0 and stats["host"]["swapped_out_blocks"] > 0
    assert_no_leaks(llm.engine)
    llm.close()


def test_n_greater_than_one_with_tiers(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("llama_gqa")
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    want, _ = _run_twice(_llm(path, num_kv_blocks=24), params, PROMPTS[:4])
    llm = _llm(path, num_kv_blocks=24, kv_disk_cache=str(tmp_path))
    got, _ = _run_twice(llm, params, PROMPTS[:4])
    assert got == want and llm.tier_stats()["disk"]["hit_tokens"] > 0
    assert_no_leaks(llm.engine)


def test_restart_serves_prefixes_from_disk_but_not_other_models_or_salts(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("llama_gqa")
    other, _ = tiny_model_factory("llama_gqa", seed=1)
    disk = str(tmp_path / "kv")
    first = _llm(path, num_kv_blocks=64, kv_disk_cache=disk)
    (a,) = first.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, cache_salt="tenant-a")
    first.close()  # writes the still-cached blocks to disk
    restarted = _llm(path, num_kv_blocks=64, kv_disk_cache=disk)
    (b,) = restarted.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, cache_salt="tenant-a")
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert b.num_cached_tokens_by_tier == {"device": 0, "disk": 20}
    (c,) = restarted.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, cache_salt="tenant-b")
    assert c.num_cached_tokens == 0 and c.outputs[0].token_ids == a.outputs[0].token_ids
    foreign = _llm(other, num_kv_blocks=64, kv_disk_cache=disk)
    (d,) = foreign.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY, cache_salt="tenant-a")
    (e,) = _llm(other, num_kv_blocks=64).generate(prompt_token_ids=[PROMPTS[0]], sampling_params=GREEDY,
                                                  cache_salt="tenant-a")
    assert d.num_cached_tokens == 0 and d.outputs[0].token_ids == e.outputs[0].token_ids


def test_ledger_shows_tiers(tiny_model_factory, tmp_path, capsys):
    path, _ = tiny_model_factory("llama_gqa")
    LLM(model=path, dtype="float32", block_size=4, num_kv_blocks=20, kv_offload_memory="64KiB", kv_disk_cache=str(tmp_path),
        kv_disk_size="1MiB")
    err = capsys.readouterr().err
    assert "kv host tier        64.00 KiB = 32 blocks = 128 tokens" in err
    assert "kv disk tier        1.00 MiB = 512 blocks" in err
    assert "per 4K-token prefix" in err and "measured prefill" in err and "preemption" in err


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"kv_offload_memory": "-1GiB"}, "kv_offload_memory"),
        ({"kv_offload_memory": "lots"}, "kv_offload_memory"),
        ({"kv_disk_cache": "DIR", "kv_disk_size": "12 parsecs"}, "kv_disk_size"),
        ({"kv_disk_size": "1GiB"}, "kv_disk_size"),
        ({"kv_disk_cache": "FILE/sub"}, "kv_disk_cache"),
        ({"preemption_mode": "teleport"}, "preemption_mode"),
        ({"kv_offload_memory": "1GiB", "enable_prefix_caching": False}, "kv_offload_memory"),
    ],
)
def test_bad_tier_values_name_the_field(tmp_path, kwargs, flag):
    """The Python API names the TierConfig field; the CLI renames it to the flag (next test)."""
    from kvforge.engine.args import EngineArgs

    (tmp_path / "FILE").write_text("not a directory")
    kwargs = {k: v.replace("DIR", str(tmp_path / "d")).replace("FILE", str(tmp_path / "FILE")) if isinstance(v, str)
              else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=flag):
        EngineArgs(**kwargs)


def test_cli_bad_tier_flags_exit_2(tiny_model_factory, tmp_path, capsys):
    from kvforge.cli import main

    path, _ = tiny_model_factory("llama_gqa")
    (tmp_path / "f").write_text("x")
    for flags, flag in ((["--kv-offload-memory", "-5"], "--kv-offload-memory"),
                        (["--kv-disk-size", "5 GiBs", "--kv-disk-cache", str(tmp_path)], "--kv-disk-size"),
                        (["--kv-disk-size", "1GiB"], "--kv-disk-size"),
                        (["--kv-disk-cache", str(tmp_path / "f" / "sub")], "--kv-disk-cache")):
        assert main(["generate", "x", "--model", path, *flags]) == 2
        assert flag in capsys.readouterr().err


def test_prometheus_exports_per_tier_counters():
    from kvforge.server.metrics import ServerMetrics

    text = ServerMetrics().render({"tiers": {"host": {"hit_tokens": 32, "bytes_read": 4096},
                                             "disk": {"hit_tokens": 16, "evictions": 2}}}, "m")
    assert 'kvforge_kv_tier_hits_tokens_total{model_name="m",tier="host"} 32.0' in text
    assert 'kvforge_kv_tier_evictions_total{model_name="m",tier="disk"} 2.0' in text
    assert "kvforge_kv_tier" not in ServerMetrics().render({}, "m")


def test_plan_shows_tiers_and_when_they_pay(capsys):
    from kvforge.cli import main

    assert main(["plan", "--model", "llama-3-8b", "--kv-offload-memory", "64GiB", "--kv-disk-size", "1TiB",
                 "--disk-bandwidth", "3GB/s", "--prefill-rate", "10000"]) == 0
    out = capsys.readouterr().out
    assert "[tier-pays]" in out and "host tier 64.00 GiB holds 32768 blocks (524288 tokens)" in out
    assert "4K-token prefix (512.00 MiB) in 179.0 ms (pays)" in out  # 512 MiB at 3 GB/s vs 409.6 ms recompute
    assert main(["plan", "--model", "llama-3-8b", "--kv-disk-size", "1TiB", "--disk-bandwidth", "0.5GB/s"]) == 0
    assert "[tier-slower-than-recompute]" in capsys.readouterr().out
    assert main(["plan", "--kv-disk-size", "-1"]) == 2 and "--kv-disk-size" in capsys.readouterr().err
