"""`benchmarks/gpu_check.sh` stays runnable: the script parses, names only parts the driver has, and the
driver's end-to-end part runs on CPU (`--smoke`: Triton interpreter, a tiny random model)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_script_parses_and_calls_only_the_drivers_parts():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    called = set(re.findall(r'gpu_check\.py "\$\{SMOKE\[@\]\}" (\w+)', SCRIPT.read_text()))
    assert called == set(gpu_check.PARTS)


@pytest.mark.slow
def test_end_to_end_part_runs_on_cpu_in_smoke_mode(tmp_path):
    out = tmp_path / "e2e.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "e2e", "--json", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["kv_capacity_tokens"] > 0
    assert all(rate > 0 for rate in result["decode_tok_s"]["eager"].values())
    assert result["decode_tok_s"]["cuda_graphs"].startswith("n/a")  # no CUDA here
