"""Print the N-th command (a 4-space-indented line) of a README section, so CI runs what the README says.

Usage: python .ci/readme_command.py "Quick start" 0
"""
from __future__ import annotations

import sys
from pathlib import Path


def section_commands(readme: str, title: str) -> list[str]:
    """The indented command lines of the `## title` section, in order."""
    lines = readme.splitlines()
    try:
        start = lines.index(f"## {title}") + 1
    except ValueError:
        raise SystemExit(f"README.md has no '## {title}' section") from None
    commands = []
    for line in lines[start:]:
        if line.startswith("## "):
            break
        if line.startswith("    ") and line.strip():
            commands.append(line.strip())
    return commands


if __name__ == "__main__":
    title, index = sys.argv[1], int(sys.argv[2])
    print(section_commands((Path(__file__).resolve().parents[1] / "README.md").read_text(), title)[index])
