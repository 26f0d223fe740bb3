"""The package's import graph has no upward arrow: each part imports only the layers below it.

Every `import kvforge...` in the source counts, lazy ones inside functions and
`TYPE_CHECKING` ones included: a lazy import still makes the lower layer depend
on the upper one. docs/DESIGN.md draws the same stack. Inside a part the same
holds module by module: no circle (engine.py -> parallel/executor.py -> engine.py
was one), so every module can be read knowing only what it imports.
"""
from __future__ import annotations

import ast
from pathlib import Path

import kvforge

# Bottom first. A part may import its own modules and any part of a lower layer, nothing else.
LAYERS: list[set[str]] = [
    {"ledger", "flags", "progress", "envs", "gguf_file"},  # KV byte arithmetic; config-field flags; progress
    # lines; the KVFORGE_* registry; a GGUF file's header and tensor table: import nothing of kvforge
    {"hf_config", "checkpoint_quant"},  # HF config.json -> model description (KVShape, windows, family), and
    # the quantization a GPTQ / AWQ checkpoint declares: pure
    {"config", "gguf_tokenizer", "native"},  # validated configs (pure); GGUF tokenizer metadata; C builds
    {"tokenizer", "planner"},  # text <-> ids; `kvforge plan` arithmetic (pure)
    {"kv"},  # blocks, coordinator (pure) and cache tensors
    {"attention"},
    {"models"},
    {"engine"},
    {"evaluation", "server"},
    {"learn"},  # `kvforge learn` demos over the engine; quant-at-length reuses evaluation's long-window scoring
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


def _module_name(path: Path) -> str:
    """`.../kvforge/engine/parallel/setup.py` -> `kvforge.engine.parallel.setup`; a package's `__init__` is the package."""
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def module_graph() -> dict[str, set[str]]:
    """Every kvforge module -> the kvforge modules it imports (`from pkg import mod` names the module)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "kvforge" or node.module.startswith("kvforge.")):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in paths else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("kvforge"))
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_import_circles_are_found():
    """The finder itself: the circle engine.py <-> parallel/ had (through setup.py) is reported whole."""
    graph = {"e.engine": {"e.parallel.setup", "e.errors"}, "e.parallel.setup": {"e.parallel.executor"},
             "e.parallel.executor": {"e.engine"}, "e.errors": set(), "e.llm": {"e.engine"}}
    assert import_circles(graph) == [["e.engine", "e.parallel.executor", "e.parallel.setup"]]
    graph["e.parallel.executor"] = {"e.errors"}
    assert import_circles(graph) == []


def test_no_import_circles_between_modules():
    assert import_circles(module_graph()) == []


def test_the_runner_holds_no_kv_bookkeeping():
    """The runner (and a tensor-parallel rank) sees the KV cache only through `SchedulerOutput`: it imports
    neither the coordinator and its pools nor the eviction tracker, and nothing imports the runner's
    engine back (docs/DESIGN.md, "Data flow of one step")."""
    bookkeeping = {"kvforge.kv.coordinator", "kvforge.kv.contiguous", "kvforge.kv.group_manager",
                   "kvforge.kv.blocks", "kvforge.engine.kv_eviction", "kvforge.engine.engine"}
    graph = module_graph()
    for runner in ("kvforge.engine.model_runner", "kvforge.engine.runner_output", "kvforge.engine.parallel.worker",
                   "kvforge.engine.parallel.executor"):
        assert graph[runner] & bookkeeping == set(), runner
