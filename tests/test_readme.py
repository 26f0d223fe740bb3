"""The README stays a guide a newcomer can follow: short, every link lands, every command in it works.

A README drifts the moment nobody runs it, so this runs it. Each command block (an indented block of
shell lines, or a ```python fence) runs as written, unless an HTML comment on the line before it says what
it needs:

- `<!-- needs: ci -->`: the install and test lines `.ci/run` itself runs in a fresh venv; checked to be the
  lines `.ci/readme_command.py` hands it (tests/test_ci_first_contact.py checks that `.ci/run` uses them).
- `<!-- needs: slow -->`: loads the default model or its tokenizer; run by a test marked `slow`.
- `<!-- needs: long -->`, `<!-- needs: server -->`, `<!-- needs: terminal -->`: takes minutes, talks to (or
  is) a server, or waits for a person; each line is parsed by the real CLI parser, so its command and
  flags exist.

```text fences are sample output and run nothing. Unmarked blocks must be cheap (the CLI's help, `kvforge
plan`): they run in the quick suite, each under a small time limit.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
KINDS = {"ci", "slow", "long", "server", "terminal"}
PARSED_ONLY = {"long", "server", "terminal"}
# Pages the README's docs index links that other work streams write; listed so a missing one is named.
INDEXED_PAGES = ["security.md", "agents.md", "evals.md", "weight-quantization.md", "gpu.md", "kv-map.md"]

sys.path.insert(0, str(ROOT / ".ci"))
from readme_command import section_commands  # noqa: E402


@dataclass(frozen=True)
class Block:
    """One command block of the README: its kind (the marker, or None), language and lines."""
    line: int  # 1-based line of the block's first line, for messages
    lang: str  # "sh" for an indented block, else the fence's language
    needs: str | None
    lines: tuple[str, ...]


def _marker(lines: list[str], i: int) -> str | None:
    """The `<!-- needs: KIND -->` comment closest above line i, if only blank lines lie between."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    m = re.fullmatch(r"<!-- needs: ([a-z]+) -->", lines[j].strip()) if j >= 0 else None
    if m and m.group(1) not in KINDS:
        raise AssertionError(f"README.md:{j + 1}: unknown marker {m.group(1)!r}; one of {sorted(KINDS)}")
    return m.group(1) if m else None


def _shell_lines(raw: list[str]) -> tuple[str, ...]:
    """Indented lines as commands: continuation backslashes joined, blank lines dropped."""
    out, pending = [], ""
    for line in raw:
        line = line.strip()
        if not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return tuple(out)


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang = line[3:].strip()
            end = lines.index("```", i + 1)
            if lang != "text":
                blocks.append(Block(i + 1, lang, _marker(lines, i), tuple(lines[i + 1:end])))
            i = end + 1
            continue
        if line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            blocks.append(Block(i + 1, "sh", _marker(lines, i), _shell_lines(lines[i:end])))
            i = end
            continue
        i += 1
    return blocks


BLOCKS = readme_blocks(README.read_text())


def _argv(command: str) -> list[str]:
    """A `kvforge ...` line as argv, its trailing `# comment` dropped."""
    argv = shlex.split(command, comments=True)
    assert argv and argv[0] == "kvforge", f"not a kvforge command: {command!r}"
    return argv[1:]


def _run_kvforge(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs this checkout's CLI (not whichever `kvforge` is on PATH) the way the entry point does."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import sys; from kvforge.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _commands(kind: str | None, lang: str = "sh") -> list[str]:
    return [c for b in BLOCKS if b.needs == kind and b.lang == lang for c in b.lines]


def test_readme_is_a_guide_not_a_notebook():
    text = README.read_text()
    n = len(text.splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move details to docs/"
    # measurement history (commit hashes, run numbers) belongs in git and docs/benchmarks.md, not here
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,12}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"README.md cites commits {hashes}"


def test_every_block_is_runnable_or_marked():
    assert BLOCKS, "no command blocks found"
    for b in BLOCKS:
        assert b.lang in ("sh", "python"), f"README.md:{b.line}: a ```{b.lang} fence; use text (output) or python"
        assert b.lines, f"README.md:{b.line}: an empty block"
        if b.lang == "python":
            compile("\n".join(b.lines), f"README.md:{b.line}", "exec")  # even the ones not run are valid Python
        if b.needs is None:
            assert b.lang == "sh", f"README.md:{b.line}: Python that runs a model needs a marker"
            for c in b.lines:
                _argv(c)  # unmarked blocks hold cheap kvforge commands only


def test_ci_blocks_are_what_ci_runs():
    """The ci-marked lines are the Quick start's install line and the suite, in the order CI reads them."""
    quick = section_commands(README.read_text(), "Quick start")
    assert _commands("ci") == quick
    install, suite, quick_run = quick
    assert install.endswith('kvforge generate "Once upon a time"')
    assert suite.endswith("python -m pytest tests")
    assert quick_run == 'python -m pytest -m "not slow" tests'  # the same suite, the slow tests left out


@pytest.mark.parametrize("command", _commands(None))
def test_cheap_commands_run(command):
    proc = _run_kvforge(_argv(command), timeout=60)
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), f"{command!r} printed nothing"


def test_commands_that_are_not_run_parse():
    """Long, server and terminal commands are not run here; the real parser proves their command and flags."""
    from kvforge.cli import build_parser
    parser = build_parser()
    commands = [c for kind in PARSED_ONLY for c in _commands(kind)]
    assert commands
    for command in commands:
        try:
            parser.parse_args(_argv(command))
        except SystemExit as exc:  # argparse's usage error
            raise AssertionError(f"README command does not parse: {command!r}") from exc


@pytest.mark.slow
@pytest.mark.parametrize("command", _commands("slow"))
def test_model_commands_run(command):
    argv = _argv(command)
    if argv[0] == "generate":
        assert "--max-tokens" in argv, f"{command!r}: a README generate keeps --max-tokens short"
    proc = _run_kvforge(argv, timeout=900)
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip()


@pytest.mark.slow
def test_python_api_block_runs():
    (code,) = ["\n".join(b.lines) for b in BLOCKS if b.lang == "python" and b.needs == "slow"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip(), "the Python API example printed nothing"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _check_links(page: Path, skip: set[str] = frozenset()) -> list[str]:
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if dest.name in skip:
            continue
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            heads = [_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)]
            if anchor not in heads:
                broken.append(target)
    return broken


def test_readme_links_resolve():
    assert not _check_links(README, skip=set(INDEXED_PAGES)), "README.md links to missing files or headings"


def test_docs_pages_links_resolve():
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert not _check_links(page, skip=set(INDEXED_PAGES)), f"{page.name} links to missing files or headings"


def test_docs_index_links_every_docs_page_and_they_exist():
    """The README's Docs section is the index: every page under docs/ is in it, and every page in it exists."""
    linked = {Path(t.partition("#")[0]).name for t in _links(README) if t.startswith("docs/")}
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert on_disk <= linked, f"docs pages missing from the README's index: {sorted(on_disk - linked)}"
    assert set(INDEXED_PAGES) <= linked
    missing = sorted(linked - on_disk)
    assert not missing, f"the README's docs index links pages that do not exist yet: {missing}"


def test_result_files_are_dated_and_named_for_what_they_measure():
    for f in (ROOT / "benchmarks" / "results").iterdir():
        assert re.match(r"\d{4}-\d{2}-\d{2}_[a-z0-9]", f.name), f"{f.name}: results files start with their date"
        assert not re.search(r"_s\d+[a-z]?\.", f.name), f"{f.name}: a run number; name what was measured"
