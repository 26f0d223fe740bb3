"""CI's first-contact step runs the README's Quick start command itself, not a copy that can drift."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_command(index: int) -> str:
    return subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_command.py"), "Quick start", str(index)],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_ci_runs_the_readme_quick_start_in_a_fresh_venv():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'QUICKSTART=$(python .ci/readme_command.py "Quick start" 0)' in ci
    assert 'python -m venv "$VENV"' in ci and "--system-site-packages" not in ci
    assert 'bash -euo pipefail -c "$QUICKSTART"' in ci
    assert "kvforge --help" in ci and "kvforge plan --model llama-3-8b" in ci
    quick = _readme_command(0)
    assert quick.startswith("pip install torch==2.13.0 -e . ") and "[" not in quick  # core install, no extras
    assert quick.endswith('kvforge generate "Once upon a time"')


def test_ci_test_line_is_the_readme_test_command():
    ci_line = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_line == _readme_command(1)
