"""Peak memory at load: the weights stream in tensor by tensor (models/weight_stream.py), so an fp32
checkpoint loaded as bf16 or int8 never holds an fp32 copy of the model.

The issue's bound is "peak RSS at load under the final weights + KV + 10%" for a 1 GB checkpoint; here a
generated ~90 MB fp32 Llama is loaded in a fresh process and its peak RSS growth is held to the final
weights + KV + 10% plus a fixed allowance for what any load allocates besides weights (kernel libraries
are loaded by a warm-up engine first). The old loader (a float32 dict of the whole checkpoint, then a
float32 model) grew by about 2x the fp32 file, several times this bound.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.load_memory import measure, write_random_llama  # noqa: E402

pytestmark = pytest.mark.slow  # two engine start-ups in fresh processes, each ~10-20 s on a loaded machine

# what a load holds besides the weights, independent of the model's size: one block of the file's pages, its
# conversion and quantization temporaries (weight_source.BLOCK_BYTES = 8 MiB of fp32: ~3x that), the allocator.
# glibc's heap makes this vary from run to run: the bf16 load grew 75.8-92.9 MiB over five runs on an idle
# machine (weights + KV 50.9 MiB), so 32 MiB failed one run in five; 48 MiB still fails the old loader's
# ~215 MiB by a wide margin.
SLACK = 48 << 20


@pytest.fixture(scope="module")
def fp32_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fp32_llama"))
    return path, write_random_llama(path)


@pytest.mark.parametrize("quantization", ["", "int8"])
def test_fp32_checkpoint_loads_within_final_weights_plus_ten_percent(fp32_llama, tiny_model_factory, quantization):
    path, file_bytes = fp32_llama
    small, _ = tiny_model_factory("llama_gqa")
    got = measure(path, small, quantization, "bfloat16", kv_blocks=8)  # in a fresh process
    bound = 1.1 * (got["weights"] + got["kv"]) + SLACK
    assert got["weights"] < file_bytes / (1.6 if not quantization else 3.5)  # bf16 (+ a packed lm_head) / int8
    assert got["growth"] <= bound, (
        f"load grew RSS by {got['growth'] / 2**20:.1f} MiB; final weights {got['weights'] / 2**20:.1f} MiB + "
        f"KV {got['kv'] / 2**20:.2f} MiB: bound {bound / 2**20:.1f} MiB (fp32 file {file_bytes / 2**20:.1f} MiB)")
    assert "reading weights" in got["load_line"] and "allocating the KV pool" in got["load_line"]
