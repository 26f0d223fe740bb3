"""benchmarks/peers.py without OpenVINO or vLLM: it skips the peers with a message, runs kvforge, and `--repeats`
reports each configuration's median run with its spread. (The peers themselves are never needed by the tests.)"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import VOCAB, build_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "peers.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("peers_model"))
    build_tiny_model(path, max_position_embeddings=4096)
    return path


@pytest.mark.slow  # six benchmark child processes
def test_repeats_report_the_median_run_and_skip_a_missing_peer(tiny: str, tmp_path) -> None:
    save = tmp_path / "peers.json"
    proc = run("--workloads", "single", "--dtype", "float32", "--kv", "model", "8bit", "--scale", "0.1",
               "--repeats", "3", "--model", tiny, "--vocab", str(VOCAB), "--save", str(save))
    assert proc.returncode == 0, proc.stderr
    assert "skipping OpenVINO GenAI" in proc.stderr  # no --openvino-model: the peer is skipped, said why
    assert "skipping vLLM" in proc.stderr  # this interpreter has no vllm (vLLM lives in its own venv)
    assert proc.stderr.count("round ") == 6  # 2 configurations x 3 rounds, round-robin
    data = json.loads(save.read_text())
    assert data["repeats"] == 3 and [r["kv"] for r in data["rows"]] == ["model", "8bit"]
    for row in data["rows"]:
        runs = sorted(row["runs_out_tok_s"])
        assert len(runs) == 3 and row["out_tok_s"] == runs[1]  # the median run is the row
        assert f"{runs[0]:.1f}-{runs[-1]:.1f}" in proc.stdout  # and the table shows the spread
    assert "8bit KV / model-dtype KV" in proc.stdout
    # and the ratio round by round, pairing runs of the same round
    model, eight = data["rows"]
    assert model["runs_round"] == eight["runs_round"] == [1, 2, 3]
    ratios = [e / m for e, m in zip(eight["runs_out_tok_s"], model["runs_out_tok_s"])]
    line = next(ln for ln in proc.stdout.splitlines() if "8bit KV / model-dtype KV" in ln)
    assert line.endswith("(per round " + ", ".join(f"{x:.2f}x" for x in ratios) + ")"), line


def test_per_round_pairs_runs_of_the_same_round() -> None:
    """A failed run drops its round from the pairing instead of shifting the later rounds."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from peers import per_round

    a = {"runs_out_tok_s": [100.0, 120.0], "runs_round": [1, 3]}
    b = {"runs_out_tok_s": [50.0, 80.0, 60.0], "runs_round": [1, 2, 3]}
    assert per_round(a, b) == [2.0, 2.0]


def test_repeats_below_one_is_a_usage_error(tiny: str) -> None:
    proc = run("--engines", "kvforge", "--repeats", "0", "--model", tiny)
    assert proc.returncode == 2 and "--repeats must be at least 1, got 0" in proc.stderr


def _benchmarks_on_path() -> None:
    path = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)


def test_model_size_presets_have_the_issue_shapes() -> None:
    """The 1b preset is issue 41's Llama (~1.07B parameters, 2.14 GB in bf16); 3b is Llama 3.2 3B's shape."""
    _benchmarks_on_path()
    from random_llama import hf_config, num_parameters, tensor_shapes

    cfg = hf_config("1b")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (2048, 16, 32, 8, 64, 8192, 49152)
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in tensor_shapes(cfg)
    assert tensor_shapes(cfg)["model.layers.15.self_attn.k_proj.weight"] == (512, 2048)
    assert num_parameters(cfg) == 1_073_809_408  # 2.15 GB in bf16
    assert 2.9e9 < num_parameters(hf_config("3b")) < 3.1e9
    with pytest.raises(ValueError, match="model size must be one of"):
        hf_config("7b")


def test_model_size_fills_in_its_defaults() -> None:
    _benchmarks_on_path()
    from peers import configs_of, parse_args

    sized = parse_args(["--model-size", "1b", "--workloads", "single", "batch"])
    assert (sized.dtype, sized.kv, sized.quantization, sized.probe) == (["bfloat16"], ["model"],
                                                                         ["none", "int8", "int4"], True)
    assert sized.save.endswith("_peers_1b_weight_formats.json")
    configs = configs_of(sized, ["kvforge", "openvino"])
    assert configs[:4] == [("single", "bfloat16", "model", "none", "kvforge"),
                           ("single", "bfloat16", "model", "none", "openvino"),
                           ("single", "bfloat16", "model", "int8", "kvforge"),
                           ("single", "bfloat16", "model", "int4", "kvforge")]  # OpenVINO: unquantized rows only
    plain = parse_args([])
    assert (plain.dtype, plain.kv, plain.quantization, plain.probe) == (["float32", "bfloat16"], ["model", "8bit"],
                                                                         ["none"], False)
    explicit = parse_args(["--model-size", "3b", "--quantization", "int8", "--dtype", "float32"])
    assert (explicit.quantization, explicit.dtype) == (["int8"], ["float32"])
    assert sized.group_size == 32 and parse_args(["--group-size", "128"]).group_size == 128  # kvforge's int4 rows
    from kvforge.config import INT4_GROUP_SIZES

    for g in INT4_GROUP_SIZES:  # the parser's spelled-out copy follows the engine's list
        assert parse_args(["--group-size", str(g)]).group_size == g
    with pytest.raises(SystemExit):
        parse_args(["--group-size", "16"])


def test_block_size_reaches_kvforge_and_is_checked(tiny: str) -> None:
    """`--block-size` is kvforge's (and vLLM's) KV block; without it each engine keeps its own default."""
    _benchmarks_on_path()
    from peers import kvforge_llm, parse_args

    from kvforge.config import CacheConfig

    assert parse_args([]).block_size is None and parse_args(["--block-size", "64"]).block_size == 64
    assert kvforge_llm("float32", "model", tiny, block_size=64).engine.config.cache_config.block_size == 64
    assert kvforge_llm("float32", "model", tiny).engine.config.cache_config.block_size == CacheConfig().block_size
    proc = run("--engines", "kvforge", "--block-size", "0", "--model", tiny)
    assert proc.returncode == 2 and "--block-size must be in [1, 1024], got 0" in proc.stderr


def test_model_size_with_a_model_is_a_usage_error() -> None:
    proc = run("--model-size", "1b", "--model", "/some/folder")
    assert proc.returncode == 2 and "--model-size builds its own model" in proc.stderr


def test_peer_rows_follow_the_folders_given() -> None:
    """OpenVINO runs int8 weights only from an int8 export (--openvino-model-int8), and then its none rows only
    from --openvino-model; vLLM runs the unquantized rows with KV in the model dtype."""
    _benchmarks_on_path()
    from peers import configs_of, openvino_models, parse_args

    both = parse_args(["--model-size", "1b", "--workloads", "single", "--quantization", "none", "int8", "--kv",
                       "model", "8bit", "--openvino-model", "OV_BF16", "--openvino-model-int8", "OV_INT8"])
    assert openvino_models(both) == {"none": "OV_BF16", "int8": "OV_INT8"}
    rows = configs_of(both, ["kvforge", "openvino", "vllm"])
    assert [(kv, q) for _, _, kv, q, e in rows if e == "openvino"] == [("model", "none"), ("model", "int8"),
                                                                        ("8bit", "none"), ("8bit", "int8")]
    assert [(kv, q) for _, _, kv, q, e in rows if e == "vllm"] == [("model", "none")]
    assert len([r for r in rows if r[-1] == "kvforge"]) == 4
    int8_only = parse_args(["--model-size", "1b", "--workloads", "single", "--quantization", "none", "int8",
                           "--openvino-model-int8", "OV"])
    assert [q for *_, q, e in configs_of(int8_only, ["openvino"])] == ["int8"]
    # no folder at all: the none rows (main skips the engine then)
    legacy = parse_args(["--model-size", "1b", "--workloads", "single"])
    assert [q for *_, q, e in configs_of(legacy, ["openvino"])] == ["none"]


def test_vllm_is_skipped_without_an_hf_folder_or_vllm(tiny: str, tmp_path) -> None:
    _benchmarks_on_path()
    from peers import vllm_missing

    assert "HF-format model folder" in vllm_missing(sys.executable, None)
    assert "HF-format model folder" in vllm_missing(sys.executable, str(tmp_path))  # no config.json
    missing = vllm_missing(sys.executable, tiny)
    if importlib.util.find_spec("vllm") is None:
        assert missing is not None and "cannot import vllm" in missing


def test_a_peer_row_in_the_wide_table_shows_its_peak_rss(capsys: pytest.CaptureFixture[str]) -> None:
    _benchmarks_on_path()
    from peers import print_row, tree_peak_rss_gb

    peaks = tree_peak_rss_gb()
    assert any(name.endswith(f" {os.getpid()}") and gb > 0 for name, gb in peaks.items())
    row = {"workload": "single", "dtype": "bfloat16", "kv": "model", "weights": "none", "engine": "vllm",
           "wall_s": 1.0, "out_tok_s": 2.0, "ttft_ms": 3.0, "mean_ttft_ms": 3.0, "decode_tok_s": 4.0,
           "peak_rss_gb": 7.25}
    print_row(row, header=True, wide=True)
    header, line = capsys.readouterr().out.splitlines()
    assert "peak RSS GB" in header and line.split()[-5:] == ["7.25", "-", "-", "-", "-"]


FAKE_LLAMA_SERVER = r'''#!PYTHON
"""A stand-in for llama.cpp's llama-server: /health, and /completion streaming one chunk per token (two tokens
in one chunk every fifth token, as llama-server does when a token ends inside a UTF-8 character). It records
its command line and every request body in LOG."""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
log = open("LOG", "a")
log.write(json.dumps({"argv": argv}) + "\n"); log.flush()


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps({"body": body}) + "\n"); log.flush()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n, k = body["n_predict"], 0
        while k < n:
            k = min(n, k + (2 if k % 5 == 3 else 1))
            time.sleep(0.001)
            self.wfile.write(f"data: {json.dumps({'tokens_predicted': k, 'stop': False})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(f"data: {json.dumps({'tokens_predicted': k, 'stop': True})}\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_llamacpp_peer_streams_every_request_through_its_server(tmp_path) -> None:
    """peer_llamacpp against a stand-in llama-server: every prompt's ids reach the server as sent, greedy and
    with EOS ignored; the meter counts every token however the chunks group them; the server gets one slot per
    request, a unified KV buffer that holds the workload, the per-step token budget and the thread count."""
    _benchmarks_on_path()
    from peer_llamacpp import run_llamacpp
    from peers import BUDGET, Meter, requests

    log = tmp_path / "log.jsonl"
    server = tmp_path / "llama-server"
    server.write_text(FAKE_LLAMA_SERVER.replace("PYTHON", sys.executable).replace("LOG", str(log)))
    server.chmod(0o755)
    work = requests("batch", seed=3, scale=0.1, vocab=VOCAB)
    res = run_llamacpp(str(server), "model-Q8_0.gguf", work, warm=True, meter_cls=Meter, threads=2, **BUDGET)
    assert res["out_tok_s"] > 0 and 0 < res["ttft_ms"] <= res["mean_ttft_ms"] and res["peak_rss_gb"] > 0
    assert round(res["out_tok_s"] * res["wall_s"]) == sum(o for _, o in work)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    argv = entries[0]["argv"]
    opt = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert opt("-m") == "model-Q8_0.gguf" and opt("-np") == str(len(work)) and "--kv-unified" in argv
    assert int(opt("-c")) >= sum(len(p) + o for p, o in work)
    assert opt("-b") == str(BUDGET["max_num_batched_tokens"]) and opt("-t") == opt("-tb") == "2"
    bodies = [e["body"] for e in entries[1:]]
    assert bodies[0]["n_predict"] == 4  # the warm-up
    sent = sorted((b["prompt"], b["n_predict"]) for b in bodies[1:])
    assert sent == sorted(work)
    assert all(b["ignore_eos"] and b["temperature"] == 0 and b["stream"] for b in bodies)


def test_llamacpp_rows_need_a_server_and_a_gguf_per_format(tmp_path) -> None:
    _benchmarks_on_path()
    from peers import configs_of, llamacpp_ggufs, llamacpp_missing, parse_args

    args = parse_args(["--model-size", "1b", "--workloads", "single", "--kv", "model", "8bit",
                       "--llamacpp-gguf", "int8=a.gguf", "int4=b.gguf"])
    assert llamacpp_ggufs(args) == {"int8": "a.gguf", "int4": "b.gguf"}
    assert [(kv, q) for _, _, kv, q, e in configs_of(args, ["llamacpp"])] == [("model", "int8"), ("model", "int4")]
    assert "no llama-server binary" in llamacpp_missing(None, {"int8": "a.gguf"})
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert "is not a file" in llamacpp_missing(str(exe), {"int8": str(tmp_path / "missing.gguf")})
    assert "no --llamacpp-gguf" in llamacpp_missing(str(exe), {})
    proc = run("--llamacpp-gguf", "q8=x.gguf")
    assert proc.returncode == 2 and "--llamacpp-gguf takes FORMAT=FILE" in proc.stderr
