"""llama.cpp as a peer of benchmarks/peers.py: its own server (`llama-server`) on a GGUF file, fed the same token
ids over HTTP, every request at once, each streamed back.

Why the server and not `llama-bench`: the peers' workloads are requests of mixed lengths arriving together,
which only llama.cpp's continuous batching (its server's slots) runs; `llama-bench` times one uniform stream.

How it is set up, to match the budget the other engines get (peers.BUDGET, KV_MEMORY_GIB):
- one slot per request, up to max_num_seqs (`-np`), one unified KV buffer (`--kv-unified`) sized to the
  workload's tokens (`-c`: every prompt + output and 64 spare per slot, at least 4,096), a logical batch of
  max_num_batched_tokens (`-b`; llama.cpp's own physical micro-batch `-ub` stays at its default);
- threads: OMP_NUM_THREADS or every CPU this process may use, for generation and for prompts (`-t`, `-tb`);
- requests: `POST /completion` with the prompt as token ids (no BOS is added to an id list),
  `n_predict` = the output length, `ignore_eos`, temperature 0 (greedy), `stream`; each streamed chunk carries
  `tokens_predicted` (cumulative), so the meter sees every token when its chunk arrives (a token that ends
  inside a UTF-8 character arrives with the next one);
- peak RSS: the server process's VmHWM, read before it is stopped.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(server: str, gguf: str, port: int, work: list[tuple[list[int], int]], threads: int,
                   max_num_seqs: int, max_num_batched_tokens: int) -> list[str]:
    slots = max(1, min(len(work), max_num_seqs))
    ctx = max(4096, sum(len(p) + o for p, o in work) + 64 * slots)
    return [server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "--kv-unified", "-c", str(ctx), "-b", str(max_num_batched_tokens), "--no-webui",
            "--no-warmup"]


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 600.0) -> None:
    """Until GET /health answers 200 (the model is loaded), or the server exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"llama-server not ready after {timeout_s:.0f} s")


def stream_completion(port: int, prompt: list[int], n: int, on_tokens: Callable[[int], None]) -> int:
    """One streamed greedy completion of `n` tokens; calls on_tokens(new) per chunk; returns the tokens made."""
    body = json.dumps({"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0.0, "stream": True,
                       "cache_prompt": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:200]!r}")
    seen = 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        chunk: dict[str, Any] = json.loads(line[6:])
        total = int(chunk.get("tokens_predicted", seen))
        if total > seen:
            on_tokens(total - seen)
            seen = total
        if chunk.get("stop"):
            break
    conn.close()
    return seen


def proc_peak_rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(ln.split(":", 1) for ln in f if ":" in ln)
    return int(fields["VmHWM"].split()[0]) * 1024 / 1e9  # kB


def run_llamacpp(server: str, gguf: str, work: list[tuple[list[int], int]], warm: bool, meter_cls: Any,
                 threads: int, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    """The workload through one llama-server process: every request sent at once from its own thread."""
    port = free_port()
    cmd = server_command(server, gguf, port, work, threads, max_num_seqs, max_num_batched_tokens)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_ready(proc, port)
            except (RuntimeError, TimeoutError):
                log.seek(0)
                print(log.read()[-4000:], file=sys.stderr)
                raise
            if warm:
                stream_completion(port, [work[0][0][0]] * 16, 4, lambda n: None)
            meter = meter_cls(len(work))
            lock = threading.Lock()
            made = [0] * len(work)
            errors: list[BaseException] = []

            def one(i: int) -> None:
                def got(n: int) -> None:
                    with lock:
                        meter.emitted(i, n)
                        meter.end_step()  # sets the decode phase's start once every request has a token
                try:
                    made[i] = stream_completion(port, work[i][0], work[i][1], got)
                except BaseException as exc:  # noqa: BLE001 - reported below, after every thread ends
                    errors.append(exc)

            clients = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
            for c in clients:
                c.start()
            for c in clients:
                c.join()
            if errors:
                raise errors[0]
            res = meter.result()
            res.pop("decode_steps_s", None)  # chunks, not engine steps: not comparable
            if made != [o for _, o in work]:
                print(f"warning: llama.cpp emitted {sum(made)} tokens, asked {sum(o for _, o in work)}",
                      file=sys.stderr)
            res["peak_rss_gb"] = proc_peak_rss_gb(proc.pid)
            res["server_command"] = " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd))
            return res
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
