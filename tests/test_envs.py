"""kvforge/envs.py is the one place a `KVFORGE_*` variable is read: declared once, typed, listed when set."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvforge import envs

ROOT = Path(__file__).resolve().parent.parent
READERS = {("os", "getenv"), ("environ", "get"), ("environ", "pop"), ("environ", "setdefault")}


def _names_read(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every read of the environment whose name is a `KVFORGE_` string or not a literal at
    all (a name held in a variable could be one): os.getenv(...), os.environ.get(...), os.environ[...]."""
    found = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = node.func.value
            owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if (owner_name, node.func.attr) in READERS:
                arg = node.args[0]
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and isinstance(node.value, ast.Attribute) and node.value.attr == "environ"):
            arg = node.slice
        if arg is None:
            continue
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if arg.value.startswith("KVFORGE_"):
                found.append((node.lineno, arg.value))
        else:
            found.append((node.lineno, ast.unparse(arg)))
    return found


def test_no_module_but_envs_reads_a_kvforge_variable():
    offenders = []
    for folder in ("kvforge", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "kvforge" / "envs.py":
                continue
            for line, what in _names_read(ast.parse(path.read_text(), str(path))):
                offenders.append(f"{path.relative_to(ROOT)}:{line} reads {what}")
    assert not offenders, "read these through kvforge.envs:\n" + "\n".join(offenders)


def test_the_checker_sees_each_kind_of_read():
    code = ('import os\nos.getenv("KVFORGE_A")\nos.environ.get("KVFORGE_B", "1")\nos.environ["KVFORGE_C"]\n'
            'name = "X"\nos.environ.get(name)\nos.environ.get("HOME")\nos.environ["KVFORGE_D"] = "1"\n')
    assert _names_read(ast.parse(code)) == [(2, "KVFORGE_A"), (3, "KVFORGE_B"), (4, "KVFORGE_C"), (6, "name")]


def test_no_c_source_reads_the_environment():
    """Settings reach the kernels as arguments or setters, never by getenv on every call."""
    for path in (ROOT / "kvforge").rglob("*.[ch]"):
        assert "getenv" not in path.read_text(), path


def test_values_are_typed_read_when_asked_and_checked(monkeypatch):
    monkeypatch.delenv("KVFORGE_LINEAR", raising=False)
    assert envs.KVFORGE_LINEAR == "auto"
    monkeypatch.setenv("KVFORGE_LINEAR", " Panel ")
    assert envs.KVFORGE_LINEAR == "panel"  # read now, not at import
    monkeypatch.setenv("KVFORGE_LINEAR", "fast")
    with pytest.raises(ValueError, match="KVFORGE_LINEAR must be one of auto, onednn, panel, both, got 'fast'"):
        envs.KVFORGE_LINEAR
    monkeypatch.setenv("KVFORGE_FUSED_OPS", "0")
    assert envs.KVFORGE_FUSED_OPS is False
    monkeypatch.setenv("KVFORGE_EXTRA_CFLAGS", "-mno-avx512f  -DX=1")
    assert envs.KVFORGE_EXTRA_CFLAGS == ("-mno-avx512f", "-DX=1")
    monkeypatch.setenv("KVFORGE_CACHE_DIR", "/tmp/kvf-cache")
    assert envs.KVFORGE_CACHE_DIR == Path("/tmp/kvf-cache")
    with pytest.raises(AttributeError):
        envs.KVFORGE_NOT_DECLARED


def test_assigning_a_declared_variable_is_refused_and_the_environment_keeps_working(monkeypatch):
    """An assignment would leave a module attribute hiding the environment for every later read (and test)."""
    monkeypatch.setenv("KVFORGE_LAST_LAYER_ROWS", "0")
    with pytest.raises(AttributeError, match="KVFORGE_LAST_LAYER_ROWS is read from the environment"):
        envs.KVFORGE_LAST_LAYER_ROWS = True
    with pytest.raises(AttributeError, match="monkeypatch.setenv"):
        setattr(envs, "KVFORGE_FUSED_OPS", False)
    assert envs.KVFORGE_LAST_LAYER_ROWS is False
    monkeypatch.setenv("KVFORGE_LAST_LAYER_ROWS", "1")
    assert envs.KVFORGE_LAST_LAYER_ROWS is True and "KVFORGE_LAST_LAYER_ROWS" not in vars(envs)


def test_every_declared_variable_has_a_comment_and_the_set_ones_are_listed(monkeypatch):
    for var in envs.VARIABLES.values():
        assert var.name.startswith("KVFORGE_") and len(var.help) > 10, var.name
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.set_variables() == []
    monkeypatch.setenv("KVFORGE_BF16_GEMM", "fma")
    monkeypatch.setenv("KVFORGE_API_KEY", "sekrit")
    listed = dict(envs.set_variables())
    assert listed == {"KVFORGE_BF16_GEMM": "fma", "KVFORGE_API_KEY": "(set)"}  # the secret is never echoed


def test_the_start_up_report_lists_the_variables_set(tiny_model_factory, monkeypatch):
    from kvforge import LLM

    path, _ = tiny_model_factory("llama_gqa")
    monkeypatch.setenv("KVFORGE_LINEAR", "onednn")
    monkeypatch.setenv("KVFORGE_API_KEY", "sekrit")
    report = LLM(model=path, num_kv_blocks=16, log_ledger=False).engine.report
    line = next(ln for ln in report.render().splitlines() if ln.strip().startswith("environment"))
    assert "KVFORGE_LINEAR=onednn" in line and "KVFORGE_API_KEY=(set)" in line and "sekrit" not in line
