"""The house rules the README's test command enforces: ruff lint and format, and the import-linter layers
contract in pyproject.toml (models -> data -> trainer infrastructure -> stages -> entry points)."""

from __future__ import annotations

import re
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


def test_every_trainer_module_has_a_layer() -> None:
    """trainer/ holds two layers (infrastructure, entry points) and a stage: a module named in no layer of the
    contract would be checked by nothing."""
    layers = re.search(r"^layers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)
    assert layers, "no layers contract in pyproject.toml"
    placed = {name.strip().strip('",') for name in re.split(r"[:|\n]", layers.group(1))}
    modules = {f"trainer.{path.stem}" for path in (ROOT / "trainer").glob("*.py") if path.stem != "__init__"}
    assert modules - placed == set()
