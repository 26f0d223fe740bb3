"""Running test code against kernels built with other compiler flags (the AVX2 / plain-C paths of an
AVX-512 machine), in a fresh process, since a process loads each kernel library once."""
from __future__ import annotations

import os
import subprocess
import sys


def run_built_with(flags: str, cache, code: str) -> None:
    """Run `code` in a fresh process whose kernels are built with KVFORGE_EXTRA_CFLAGS=flags into the kernel
    cache `cache`; it must print 'ok' last."""
    env = dict(os.environ, KVFORGE_EXTRA_CFLAGS=flags, KVFORGE_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["ok"], out.stderr[-2000:]
