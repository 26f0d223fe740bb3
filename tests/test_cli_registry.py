"""The command registry: one table, parsers that import no torch, core dependencies only, loud import failures."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import kvforge.commands
from kvforge.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS_DIR = ROOT / "kvforge" / "commands"


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


# ---- no torch where no model runs ----------------------------------------------------------

_HEAVY = "[m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'fastapi', 'uvicorn', 'httpx')]"


def test_help_and_plan_import_no_torch():
    code = (
        "import sys, contextlib, io\n"
        "from kvforge.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    assert main(['plan', '--model', 'llama-3-8b']) == 0\n"
        "    assert main(['plan', '--compare', 'llama-2-7b,llama-3-8b,deepseek-v2']) == 0\n"
        f"print({_HEAVY})\n"
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"heavy modules imported: {proc.stdout}"


def test_cache_explain_loads_only_the_tokenizer(tiny_model_factory):
    path, _ = tiny_model_factory("llama_gqa")
    code = (
        "import sys\n"
        "from kvforge.cli import main\n"
        f"rc = main(['cache', 'explain', '--model', {path!r}, '--block-size', '4', '--json', "
        "'The same system prompt, then question one.', 'The same system prompt, then question two.'])\n"
        "assert rc == 0\n"
        f"print({_HEAVY})\n"
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    report, heavy = proc.stdout.rsplit("\n", 2)[0], proc.stdout.strip().splitlines()[-1]
    assert heavy == "[]", f"heavy modules imported: {heavy}"
    assert json.loads(report)["hit_blocks"] >= 1


# ---- core dependencies only ----------------------------------------------------------------

def _core_distributions() -> set[str]:
    """kvforge's core dependencies (pyproject.toml, no extras) and everything they require, normalised."""
    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in deps]
    seen: set[str] = set()
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [re.split(r"[<>=!~;\[ (]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]
    return seen


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported when `path` is imported (not inside functions or TYPE_CHECKING)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return names


def _is_allowed(top: str, core: set[str], dists: dict[str, list[str]]) -> bool:
    if top in sys.stdlib_module_names or top in ("kvforge", "__future__"):
        return True
    return any(re.sub(r"[-_.]+", "-", d).lower() in core for d in dists.get(top, []))


def test_command_modules_import_only_core_dependencies_at_module_level():
    core, dists = _core_distributions(), metadata.packages_distributions()
    assert "httpx" in core  # `bench serve` needs it: a core dependency since a fresh install crashed without it
    for path in sorted(COMMANDS_DIR.glob("*.py")):
        bad = [m for m in _module_level_imports(path) if not _is_allowed(m, core, dists)]
        assert not bad, f"{path.name} imports non-core {bad} at module level: import inside run() instead"


def test_building_the_parser_imports_only_core_dependencies():
    """The whole import graph behind the parser, not just the commands' own lines."""
    proc = _run_python("import sys\nfrom kvforge.cli import build_parser\nbuild_parser()\n"
                       "print(sorted({m.split('.')[0] for m in sys.modules}))")
    assert proc.returncode == 0, proc.stderr
    core, dists = _core_distributions(), metadata.packages_distributions()
    loaded = [m for m in eval(proc.stdout) if not m.startswith("_")]
    bad = [m for m in loaded if m in dists and not _is_allowed(m, core, dists)]
    assert not bad, f"building the parser imports non-core packages {bad}"


def test_helper_detects_non_core_imports(tmp_path):
    """The check above can fail: a module importing an extra at module level is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import argparse\nimport matplotlib.pyplot as plt\nif False:\n    import transformers\n"
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import openai\n"
                   "def run():\n    import torch\n")
    core, dists = _core_distributions(), metadata.packages_distributions()
    found = {m for m in _module_level_imports(bad) if not _is_allowed(m, core, dists)}
    assert found == {"matplotlib", "transformers"}


# ---- one registry, loud failures -----------------------------------------------------------

def test_every_registered_command_is_in_the_parser():
    parser = build_parser()
    for path in kvforge.commands.COMMANDS:
        args = parser.parse_args([*path.split(), *(["a", "b"] if path == "cache explain" else [])])
        assert args.command_path == path and callable(args.func)


def test_broken_command_import_is_an_error_naming_the_command(monkeypatch, capsys):
    monkeypatch.setitem(kvforge.commands.COMMANDS, "frobnicate", "kvforge.commands.no_such_module")
    assert main(["plan"]) == 1
    err = capsys.readouterr().err
    assert "'frobnicate' command could not be loaded" in err and "no_such_module" in err


def test_help_shows_defaults(capsys):
    for argv, expected in ((["generate"], "(default: 128)"), (["chat"], "(default: 256)"),
                           (["serve"], "(default: 8000)"), (["eval", "kv-quant"], "16 rows"),
                           (["plan"], "(default: 4096)"), (["bench", "serve"], "(default: 64)")):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert expected in out, (argv, expected)
        assert "(default: None)" not in out


def test_eval_help_row_count_matches_the_default_formats():
    from kvforge.commands.eval import DEFAULT_ROWS
    from kvforge.evaluation.kv_quant import DEFAULT_VARIANTS, Variant, measured_variants

    assert len(measured_variants([Variant.parse(s) for s in DEFAULT_VARIANTS])) == DEFAULT_ROWS
    assert f"measures {DEFAULT_ROWS} rows" in " ".join(kvforge.commands.eval.__doc__.split())


def test_engine_defaults_live_in_one_place():
    """Flags, LLM keywords, the planner and `cache explain` read the same default: change it once, all follow."""
    from kvforge import ledger
    from kvforge.engine.args import EngineConfig
    from kvforge.planner.capacity import PlanOptions

    parser = build_parser()
    gen = parser.parse_args(["generate", "x"])
    cfg = EngineConfig()
    assert gen.block_size == cfg.cache_config.block_size == ledger.DEFAULT_BLOCK_SIZE == PlanOptions().block_size
    assert parser.parse_args(["cache", "explain", "a", "b"]).block_size == ledger.DEFAULT_BLOCK_SIZE
    assert gen.max_num_seqs == cfg.scheduler_config.max_num_seqs == ledger.DEFAULT_MAX_NUM_SEQS
    assert gen.max_num_batched_tokens == cfg.scheduler_config.max_num_batched_tokens
    assert cfg.cache_config.kv_cache_memory == 1 << 30  # parsed once, in CacheConfig
    assert EngineConfig.create(kv_cache_memory="2GiB").cache_config.kv_cache_memory == 2 << 30
    assert EngineConfig.create(num_kv_blocks=8).cache_config.kv_cache_memory is None  # blocks, not bytes


def test_engine_config_routes_flat_options_and_rejects_unknown_ones():
    from kvforge.engine.args import EngineArgs, EngineConfig

    cfg = EngineArgs(model="m", dtype="bfloat16", block_size=32, max_num_seqs=4, seed=3)
    assert (cfg.model_options.model, cfg.model_options.dtype, cfg.model_options.seed) == ("m", "bfloat16", 3)
    assert (cfg.cache_config.block_size, cfg.scheduler_config.max_num_seqs) == (32, 4)
    assert cfg.replace(kv_cache_dtype="int8").cache_config.kv_cache_dtype == "int8"
    assert cfg.to_dict()["block_size"] == 32 and EngineConfig.create(**cfg.to_dict()) == cfg
    with pytest.raises(TypeError, match="unknown engine option 'blok_size'"):
        EngineArgs(blok_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=0)
    assert EngineArgs(tensor_parallel_size=2).parallel_config.tensor_parallel_size == 2  # h19: TP is implemented
    with pytest.raises(ValueError, match="kv_cache_scale='tensor'"):  # a check across sections
        EngineArgs(tensor_parallel_size=2, kv_cache_scale="tensor")
