"""benchmarks/quiet.py: who else is using the CPU before a benchmark run, and an engine's process group that
dies with the run (an aborted peers.py once left a vLLM worker beside the next run)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
from quiet import busy_processes, describe, run_group  # noqa: E402

linux = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")


def _gone(pid: int) -> bool:
    """True once pid has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


@linux
def test_a_spinning_process_is_named_and_an_idle_one_is_not() -> None:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)  # past the interpreters' start
        busy = busy_processes(interval=0.5)
        pids = {pid: share for pid, _, share in busy}
        assert spin.pid in pids and pids[spin.pid] > 0.3, busy
        assert idle.pid not in pids and os.getpid() not in pids
        assert f"(pid {spin.pid})" in describe(busy)
    finally:
        spin.kill(), idle.kill(), spin.wait(), idle.wait()


@linux
def test_run_group_leaves_no_process_of_the_run_behind(tmp_path: Path) -> None:
    """The command returns while a process it started lives on (as vLLM's workers can): killed with it."""
    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    proc = run_group(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; echo done"], stdout=subprocess.PIPE, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "done"
    assert time.monotonic() - t0 < 30  # the leftover holds stdout open: not waited for
    assert _wait_gone(int(pid_file.read_text()))


@linux
def test_sigterm_to_the_benchmark_kills_the_engines_group(tmp_path: Path) -> None:
    """`kill` of peers.py (SIGTERM) mid-run takes the engine's whole process group with it."""
    pid_file = tmp_path / "pid"
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(BENCH)!r})
        from quiet import run_group
        run_group(["sh", "-c", "sleep 60 & echo $! > {pid_file}; wait"])
    """))
    parent = subprocess.Popen([sys.executable, str(script)])
    try:
        end = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < end:
            time.sleep(0.05)
        sleeper = int(pid_file.read_text())
        assert not _gone(sleeper)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=20) == 128 + signal.SIGTERM
        assert _wait_gone(sleeper)
    finally:
        parent.kill()
