"""The house rules the README's test command enforces: ruff lint and format, and the import-linter layers
contract in pyproject.toml (models -> data -> trainer infrastructure -> stages -> entry points)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str) -> str:
    """The tool installed beside this Python (the test extra), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["lint-imports"]],
    ids=["ruff-lint", "ruff-format", "import-layers"],
)
def test_tree_is_clean(command: list[str]) -> None:
    result = subprocess.run([tool(command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-4000:]}{result.stderr[-2000:]}"
