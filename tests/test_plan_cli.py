"""`kvforge plan` end to end through `kvforge.cli.main`: every flag, and bad input exits 2 with a message."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvforge.cli import main
from kvforge.planner.presets import PRESETS


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def row(out: str, label: str) -> list[str]:
    """The cells of the table row starting with `label` (cells are separated by 2+ spaces)."""
    import re

    line = next(line for line in out.splitlines() if line.startswith(label))
    return re.split(r"\s{2,}", line[len(label):].strip())


def test_llama3_8b_table(capsys):
    code, out, _ = plan(capsys, "--model", "llama-3-8b", "--kv-cache-dtype", "fp16")
    assert code == 0
    assert row(out, "per token per layer") == ["4.00 KiB"]
    assert row(out, "per token (all layers)") == ["128.00 KiB"]
    assert row(out, "per sequence (4096 tokens)") == ["512.00 MiB"]
    assert row(out, "32 sequences x 4096") == ["16.00 GiB"]
    assert row(out, "weights") == ["14.96 GiB (bf16)"]  # 8,030,261,248 params x 2 bytes
    assert row(out, "attention") == ["GQA 4:1"]


def test_default_model_is_smollm2(capsys):
    code, out, _ = plan(capsys)
    assert code == 0 and "smollm2-135m" in out
    assert row(out, "per token per layer") == ["768 B"]  # 2 x 3 heads x 64 x 2 bytes


def test_json_has_exact_bytes_and_capacity(capsys):
    code, out, _ = plan(capsys, "--model", "llama-3-8b", "--gpu-memory", "80GiB", "--json")
    assert code == 0
    doc = json.loads(out)
    cfg = doc["configs"][0]
    assert cfg["kv_bytes"]["per_token"] == 131072 and cfg["kv_bytes"]["batch"] == 16 * 1024**3
    cap = cfg["capacity"]
    assert cap["kv_memory"] == int(80 * 1024**3 * 0.9) - cfg["weights_bytes"] - cap["activations"]
    assert cap["num_blocks"] == cap["kv_memory"] // (2 * 1024**2) - 1  # the engine's pool, less its null block
    assert cap["concurrency_at_max"] == cap["num_blocks"] // (8192 // 16)
    assert doc["options"]["gpu_memory"] == 80 * 1024**3


def test_capacity_rows_and_concurrency_at_both_lengths(capsys):
    code, out, _ = plan(capsys, "--model", "llama-3-8b", "--gpu-memory", "80GiB", "--memory-utilization", "0.9",
                        "--max-num-batched-tokens", "8192", "--max-model-len", "32768", "--avg-seq-len", "2048")
    assert code == 0
    assert row(out, "budget") == ["72.00 GiB"]
    blocks = int(row(out, "KV blocks")[-1].replace(",", ""))
    assert row(out, "sequences at max_model_len") == [f"{blocks // 2048} @ 32768"]
    assert row(out, "sequences at avg length") == [f"{blocks // 128} @ 2048"]
    assert "[max-model-len-waste]" in out and "[prefill-peak]" in out


def test_compare_models_side_by_side(capsys):
    code, out, _ = plan(capsys, "--compare", "llama-2-7b,llama-3-8b,deepseek-v2", "--kv-cache-dtype", "bf16")
    assert code == 0
    assert row(out, "attention") == ["MHA", "GQA 4:1", "MLA"]
    assert row(out, "per token (all layers)") == ["512.00 KiB", "128.00 KiB", "67.50 KiB"]


def test_compare_dtypes_and_separate_k_v(capsys):
    code, out, _ = plan(capsys, "--model", "llama-3-8b", "--compare", "fp16,fp8,int4@tensor,fp8/fp16", "--json")
    per_token = [c["kv_bytes"]["per_token"] for c in json.loads(out)["configs"]]
    assert code == 0
    # fp8 takes per-token scales by default (ledger.DEFAULT_KV_SCALES, measured): 4 bytes per token for K and V
    assert per_token == [131072, 32 * (2048 + 2 * 4), 32768, 32 * (1024 + 4 + 2048)]


def test_kv_cache_dtype_and_scales_flags(capsys):
    code, out, _ = plan(capsys, "--model", "llama-3-8b", "--kv-cache-dtype", "int8", "--kv-scales", "head", "--json")
    cfg = json.loads(out)["configs"][0]
    assert code == 0 and cfg["kv_cache_format"] == {"k_dtype": "int8", "v_dtype": "int8", "scale_granularity": "head"}
    assert cfg["kv_bytes"]["per_token_per_layer"] == 2048 + 2 * 8 * 4


def test_model_overrides_and_config_file(capsys, tmp_path):
    code, out, _ = plan(capsys, "--compare", "llama-3-8b,llama-3-8b:num_key_value_heads=1", "--json")
    assert code == 0 and [c["kv_bytes"]["per_token"] for c in json.loads(out)["configs"]] == [131072, 16384]
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    cfg = dict(PRESETS["llama-3-8b"])
    del cfg["num_key_value_heads"]  # the classic mistake
    (model_dir / "config.json").write_text(json.dumps(cfg))
    code, out, _ = plan(capsys, "--model", str(model_dir))
    assert code == 0 and "my-model" in out and "[missing-num-key-value-heads]" in out and "4x smaller" in out
    code, out, _ = plan(capsys, "--model", str(model_dir / "config.json"), "--json")
    assert code == 0 and json.loads(out)["configs"][0]["kv_bytes"]["per_token"] == 4 * 131072


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "kv.png"
    code, _, err = plan(capsys, "--compare", "llama-3-8b,mistral-7b", "--gpu-memory", "80GiB", "--plot", str(path))
    assert code == 0 and f"wrote {path}" in err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_prompts_and_offload_lints(capsys, tmp_path):
    system = "You are a careful assistant. Follow the policy below in every answer. " * 20
    prompts = [f"Time: 2024-05-0{i} 12:0{i}:00\n{system}\nUser: q{i}" for i in range(1, 4)]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    code, out, _ = plan(capsys, "--model", "llama-3-8b", "--prompts", str(tmp_path / "p.json"),
                        "--offload-bandwidth", "32GB/s")
    assert code == 0 and "[prefix-cache-killer]" in out and "timestamp" in out
    assert "[offload-cannot-help]" in out and "16.8 ms" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-9000"], "neither a preset nor an existing file"),
    (["--gpu-memory=-80GiB"], "--gpu-memory must be >= 0"),
    (["--gpu-memory", "lots"], "cannot parse"),
    (["--model", "llama-3-70b", "--gpu-memory", "80GiB"], "smaller than the weights"),
    (["--memory-utilization", "1.5", "--gpu-memory", "80GiB"], "--memory-utilization must be in (0, 1]"),
    (["--kv-cache-dtype", "fp7"], "not supported"),
    (["--compare", "fp16,fp9/"], "neither a preset"),
    (["--gpu-memory", "80GiB", "--avg-seq-len", "9000"], "exceeds max_model_len 8192"),
    (["--offload-bandwidth", "0GB/s"], "--offload-bandwidth must be > 0"),
    (["--model", "llama-3-8b:num_key_value_heads=-2"], "must be a positive integer"),
])
def test_bad_input_exits_2_with_a_clear_message(capsys, argv, message):
    code, out, err = plan(capsys, *argv)
    assert code == 2 and message in err and out == ""


@pytest.mark.parametrize("argv", [["--seq-len", "-5"], ["--batch", "0"], ["--block-size", "x"], ["--json=1"]])
def test_argparse_errors_exit_2(capsys, argv):
    code, _, err = plan(capsys, *argv)
    assert code == 2 and "error" in err


def test_malformed_and_incomplete_configs_exit_2(capsys, tmp_path):
    (tmp_path / "broken.json").write_text("{ not json")
    code, _, err = plan(capsys, "--model", str(tmp_path / "broken.json"))
    assert code == 2 and "not valid JSON" in err
    (tmp_path / "list.json").write_text("[1, 2]")
    code, _, err = plan(capsys, "--model", str(tmp_path / "list.json"))
    assert code == 2 and "must be a JSON object" in err
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    code, _, err = plan(capsys, "--model", str(tmp_path / "partial.json"))
    assert code == 2 and "num_hidden_layers" in err


def test_planner_imports_no_torch_and_no_matplotlib():
    code = ("import sys, kvforge.commands.plan, kvforge.planner.lints, kvforge.planner.prefix, kvforge.ledger; "
            "bad = [m for m in ('torch', 'matplotlib') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
