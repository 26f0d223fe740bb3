"""The disk tier survives a plain exit and a SIGKILL (docs/security.md, "Durable disk tier").

- A script that generates and exits without `close()` leaves its prefix on disk: a fresh
  process gets >= 90% of the prompt from disk.
- Writers killed with SIGKILL at random points, 20 times over one directory, leave only whole,
  verifiable `.kvb` files; each next writer (and a last fresh engine) produces exactly the
  reference tokens. Writers are forked from a forkserver that has imported torch, so 20 of them cost one
  torch import.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

import durability_writer as writer
from kvforge import LLM, SamplingParams
from kvforge.kv.tiers.disk import MAGIC, SUFFIX, TMP_MARK

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
def test_plain_script_without_close_leaves_its_prefix_on_disk(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("llama_gqa")
    disk = str(tmp_path / "kv")
    prompt = [(13 * i + 5) % 250 for i in range(201)]
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(f"""
        from kvforge import LLM, SamplingParams
        llm = LLM(model={path!r}, block_size=4, max_model_len=256, kv_disk_cache={disk!r}, log_ledger=False)
        llm.generate(prompt_token_ids=[{prompt!r}], sampling_params=SamplingParams(temperature=0, max_tokens=2))
        print("done")  # and exit: no llm.close(), as most scripts end
    """))
    run = subprocess.run([sys.executable, str(script)], env=_child_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-2000:]
    fresh = LLM(model=path, block_size=4, max_model_len=256, kv_disk_cache=disk, log_ledger=False)
    (out,) = fresh.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
    (want,) = LLM(model=path, block_size=4, max_model_len=256, log_ledger=False).generate(
        prompt_token_ids=[prompt], sampling_params=GREEDY)
    assert out.num_cached_tokens_by_tier["disk"] >= 0.9 * len(prompt), out.num_cached_tokens_by_tier
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    fresh.close()


def _verifiable(directory: str) -> list[str]:
    """Names of `.kvb` files that are not whole (magic, header, payload length and SHA-256 as written)."""
    import hashlib
    import json
    import struct

    bad = []
    for root, _, files in os.walk(directory):
        for name in files:
            if not name.endswith(SUFFIX):
                continue
            blob = open(os.path.join(root, name), "rb").read()
            fixed = len(MAGIC) + 8
            try:
                _, hlen = struct.unpack_from("<II", blob, len(MAGIC))
                header = json.loads(blob[fixed:fixed + hlen])
                payload = blob[fixed + hlen:]
                ok = (blob.startswith(MAGIC) and header["payload_len"] == len(payload)
                      and header["sha256"] == hashlib.sha256(payload).hexdigest() and header["key"] + SUFFIX == name)
            except (ValueError, KeyError, struct.error):
                ok = False
            if not ok:
                bad.append(name)
    return bad


@pytest.mark.slow
def test_sigkilled_writers_leave_no_wrong_output_over_20_trials(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("llama_gqa")
    disk = str(tmp_path / "kv")
    ps = writer.prompts()
    ref_llm = LLM(model=path, **writer.engine_kwargs(None))
    reference = [list(o.outputs[0].token_ids) for o in ref_llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    ctx = mp.get_context("forkserver")
    # torch only: importing kvforge runs a oneDNN probe that starts OpenMP threads, and a child forked after
    # that hangs in its first parallel region; each writer imports kvforge itself
    ctx.set_forkserver_preload(["torch"])
    rng = random.Random(0)
    wrong, kills = [], 0
    for trial in range(20):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=writer.write_until_killed, args=(path, disk, reference, trial, child), daemon=True)
        proc.start()
        child.close()
        try:
            for _ in range(rng.randint(1, 6)):  # kill after a random number of generations ...
                assert parent.poll(180), f"trial {trial}: the writer gave no output (exit code {proc.exitcode})"
                msg = parent.recv()
                if msg != "ok":
                    wrong.append((trial, msg))
            if rng.random() < 0.5:  # ... or somewhere inside the next one
                parent.poll(rng.uniform(0, 0.2))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            parent.close()
        kills += proc.exitcode == -signal.SIGKILL
    assert wrong == [] and kills == 20
    assert _verifiable(disk) == []
    fresh = LLM(model=path, **writer.engine_kwargs(disk))  # the scan also removes killed writers' temporary files
    outs = fresh.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    assert sum(o.num_cached_tokens_by_tier["disk"] for o in outs) > 0  # the killed writers' blocks were used
    assert not any(TMP_MARK in n for _, _, files in os.walk(disk) for n in files)
    fresh.close()
