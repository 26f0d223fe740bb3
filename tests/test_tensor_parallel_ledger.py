"""Per-device KV under tensor parallelism: the ledger's split and replication, and `kvforge plan -tp`."""
from __future__ import annotations

import json

import pytest

from kvforge.cli import main
from kvforge.ledger import KVShape, kv_bytes_per_token, tensor_parallel_kv


@pytest.mark.parametrize("kv_heads,tp,per_device,replication", [
    (8, 1, 8, 1), (8, 2, 4, 1), (8, 8, 1, 1), (8, 16, 1, 2), (1, 4, 1, 4), (2, 4, 1, 2),
])
def test_kv_heads_split_or_replicated(kv_heads, tp, per_device, replication):
    layout = tensor_parallel_kv(KVShape(32, kv_heads, 128), tp)
    assert (layout.per_device.num_kv_heads, layout.replication) == (per_device, replication)
    # every KV head is stored `replication` times across the devices, never fewer than once
    assert layout.per_device.num_kv_heads * tp == kv_heads * replication


def test_mla_latent_is_replicated_on_every_device():
    shape = KVShape(60, 1, 576, mla_latent_dim=576)
    layout = tensor_parallel_kv(shape, 8)
    assert layout.per_device == shape and layout.replication == 8 and not layout.sharded
    assert kv_bytes_per_token(layout.per_device, "float16") == kv_bytes_per_token(shape, "float16")


def test_heads_that_do_not_divide_are_a_clear_error():
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide num_key_value_heads=6"):
        tensor_parallel_kv(KVShape(2, 6, 64), 4)
    with pytest.raises(ValueError, match="num_key_value_heads=3 must divide tensor_parallel_size=4"):
        tensor_parallel_kv(KVShape(2, 3, 64), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tensor_parallel_kv(KVShape(2, 8, 64), 0)


def test_plan_shows_per_device_kv_and_replication(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--tensor-parallel-size", "16", "--gpu-memory", "80GiB",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cfg = doc["configs"][0]
    assert cfg["tensor_parallel"] == {"size": 16, "kv_heads_per_device": 1, "replication": 2}
    assert cfg["kv_bytes"]["per_token"] == 32 * 1 * 128 * 2 * 2  # one KV head per device, bf16, K and V
    one = main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80GiB", "--json"])
    assert one == 0
    single = json.loads(capsys.readouterr().out)["configs"][0]
    # 8 devices: an eighth of the KV per token and of the weights, so far more sequences per device
    assert main(["plan", "--model", "llama-3-8b", "--tensor-parallel-size", "8",
                 "--gpu-memory", "80GiB", "--json"]) == 0
    eight = json.loads(capsys.readouterr().out)["configs"][0]
    assert eight["kv_bytes"]["per_token"] * 8 == single["kv_bytes"]["per_token"]
    assert eight["capacity"]["concurrency_at_max"] > 8 * single["capacity"]["concurrency_at_max"]
    assert main(["plan", "--model", "llama-3-8b", "--tensor-parallel-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "tensor parallel x16" in text and "1 of 8" in text and "x2" in text
    assert main(["plan", "--model", "llama-3-8b", "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size=3" in capsys.readouterr().err
