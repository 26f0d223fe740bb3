"""The package's import graph has no upward arrow: each part imports only the layers below it.

Every `import kvforge...` in the source counts, lazy ones inside functions and
`TYPE_CHECKING` ones included: a lazy import still makes the lower layer depend
on the upper one. docs/DESIGN.md draws the same stack.
"""
from __future__ import annotations

import ast
from pathlib import Path

import kvforge

# Bottom first. A part may import its own modules and any part of a lower layer, nothing else.
LAYERS: list[set[str]] = [
    {"ledger", "flags", "progress", "envs"},  # KV byte arithmetic; config-field flags; progress lines; the
    # KVFORGE_* registry: import nothing of kvforge
    {"hf_config"},  # HF config.json -> model description (KVShape, windows, family): pure
    {"config", "gguf_tokenizer", "native"},  # validated configs (pure); GGUF tokenizer metadata; C builds
    {"tokenizer", "planner"},  # text <-> ids; `kvforge plan` arithmetic (pure)
    {"kv"},  # blocks, coordinator (pure) and cache tensors
    {"attention"},
    {"models"},
    {"engine"},
    {"evaluation", "server", "learn"},  # learn: `kvforge learn` demos over the engine
    {"distributed"},  # replicas: the KV-affinity router and the Ray Serve deployment (serves with server/)
    {"commands"},  # one module per `kvforge` subcommand, and the registry
    {"cli", "__init__", "__main__"},
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}
ROOT = Path(kvforge.__file__).parent


def _part(module: str) -> str:
    """`kvforge.kv.blocks` -> `kv`; `kvforge.cli` -> `cli`; `kvforge` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kvforge":  # `from kvforge import ledger`
                found.update(f"kvforge.{a.name}" for a in node.names)
            elif node.module.startswith("kvforge."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name == "kvforge" or a.name.startswith("kvforge."))
    return found


def test_every_part_of_the_package_is_placed_in_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts - set(RANK) == set(), "place the new part in LAYERS (and in docs/DESIGN.md)"


def test_no_upward_imports():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        source = _part(".".join(rel.parts))
        for target in sorted(_imports(path)):
            dest = _part(target)
            if dest != source and RANK[dest] >= RANK[source]:
                upward.append(f"{rel}: imports {target} ({dest} is not below {source})")
    assert upward == []
