"""The house rules the README's test command enforces: ruff lint and format, and the import-linter layers
contracts in pyproject.toml (models -> data -> trainer -> alignment; inside alignment: schemas -> shared -> stages
-> commands)."""

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


def test_the_contracts_name_whole_packages() -> None:
    """The layers are packages, not modules: the four top-level packages, and alignment's sub-packages (commands,
    stages, shared, schemas). A module beside those sub-packages, or a sub-package named in no layer, would be
    checked by nothing; data/ is sub-packages by concern, with no loose modules either."""
    text = (ROOT / "pyproject.toml").read_text()
    layer_lists = re.findall(r"^layers = \[(.*?)\]", text, re.S | re.M)
    assert len(layer_lists) == 2, layer_lists
    top, inside = ({name.strip().strip('"') for name in found.split(",")} for found in layer_lists)
    assert top == {"alignment", "trainer", "data", "models"}
    assert re.search(r'^containers = \["alignment"\]', text, re.M)
    for package, named in (("alignment", inside), ("data", None)):
        folder = ROOT / package
        loose = [path.name for path in folder.glob("*.py") if path.name != "__init__.py"]
        assert loose == [], f"{package}/ has modules outside its sub-packages: {loose}"
        subpackages = {path.parent.name for path in folder.glob("*/__init__.py")}
        if named is not None:
            assert subpackages == named, f"alignment's sub-packages {subpackages} vs the contract's {named}"
