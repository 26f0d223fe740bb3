"""`kvforge serve` as a user runs it: a subprocess on a free port, KVFORGE_API_KEY from the environment."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvforge.cli import main
from kvforge.commands.serve import served_model_name
from tiny_models import build_tiny_model
from server_fixtures import wait_for_health

pytestmark = pytest.mark.slow  # `kvforge serve` subprocesses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_usage_errors_exit_2(capsys):
    assert main(["serve", "--port", "70000"]) == 2
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--port" in err and "--max-num-seqs" in err


def test_served_model_name():
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/foo.gguf") == "foo"
    assert served_model_name("/models/my-llama/") == "my-llama"


def test_kvforge_serve_subprocess_with_api_key_env(tmp_path):
    model = str(tmp_path / "tiny")
    build_tiny_model(model, "llama_gqa")
    port = _free_port()
    env = {**os.environ, "KVFORGE_API_KEY": "env-key"}
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", "--model", model, "--port", str(port),
           "--num-kv-blocks", "64", "--max-model-len", "128", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, 90)
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer env-key"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.json()["model"] == "tiny"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("kvforge serve did not exit on SIGINT")
