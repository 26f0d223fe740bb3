"""Is the machine quiet? The processes that used the CPU over a short window, and a process group that
dies with the benchmark.

Why: on a 2-core VM one other busy process stalls every OpenMP barrier of the engine under test, so a ratio
measured beside it is not the engines'. An aborted peers.py run once left a vLLM worker behind (5.4 GB, ~5%
of a core) that sat beside the next run unnoticed. peers.py checks before each engine run and says who was
busy, and runs each engine in a process group of its own that it kills when the run ends or is interrupted,
so no engine process outlives it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time


def _cpu_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (name, user + system clock ticks so far), for every process readable in /proc."""
    out: dict[int, tuple[str, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the name is in parentheses and may hold spaces; the fields after it are space separated
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(entry)] = (name, int(rest[11]) + int(rest[12]))  # utime, stime (fields 14, 15)
    return out


def busy_processes(interval: float = 0.5, min_share: float = 0.02) -> list[tuple[int, str, float]]:
    """Processes other than this one that used at least `min_share` of a core over `interval` seconds:
    (pid, name, share of a core), busiest first. Empty where /proc cannot be read (not Linux)."""
    if not os.path.isdir("/proc"):
        return []
    hz = os.sysconf("SC_CLK_TCK")
    before = _cpu_ticks()
    t0 = time.monotonic()
    time.sleep(interval)
    after = _cpu_ticks()
    elapsed = time.monotonic() - t0
    me = os.getpid()
    busy = []
    for pid, (name, ticks) in after.items():
        if pid == me or pid not in before:
            continue
        share = (ticks - before[pid][1]) / hz / elapsed
        if share >= min_share:
            busy.append((pid, name, share))
    return sorted(busy, key=lambda b: -b[2])


def describe(busy: list[tuple[int, str, float]]) -> str:
    return ", ".join(f"{name} (pid {pid}) {share:.0%} of a core" for pid, name, share in busy)


def run_group(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """subprocess.run(cmd, **kwargs) in a new session, whose process group is killed when it returns, fails or
    is interrupted (SIGTERM to this process included): engines that start workers of their own (vLLM's
    engine core and worker) leave none behind, and a leftover holding the output pipe open does not keep
    this waiting."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # type: ignore[no-untyped-def]
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=1.0)
                return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:  # retrying loses no output
                if proc.poll() is not None:  # the command is done: what keeps its pipes open is left over
                    _kill_group(proc.pid)
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        _kill_group(proc.pid)
        proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
