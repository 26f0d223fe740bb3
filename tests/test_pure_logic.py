"""The pure-logic modules (ledger, HF config reader, block pool, KV coordinator, scheduler) never import torch (docs/DESIGN.md)."""
from __future__ import annotations

import subprocess
import sys

PURE = ["kvforge.ledger", "kvforge.hf_config", "kvforge.config", "kvforge.kv.hashing", "kvforge.kv.blocks", "kvforge.kv.interface", "kvforge.kv.stats",
        "kvforge.kv.group_manager", "kvforge.kv.coordinator", "kvforge.kv.contiguous", "kvforge.kv.utilization",
        "kvforge.kv.explain", "kvforge.kv.block_map", "kvforge.kv.events", "kvforge.engine.scheduler", "kvforge.engine.request", "kvforge.engine.sampling_params"]


def test_pure_logic_modules_do_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in PURE) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
