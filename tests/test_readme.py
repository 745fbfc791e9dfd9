"""The README's commands are the ones CI runs: its test command appears in `.ci/run` character for character; and
every test the fault table in `docs/faults.md` names exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_command(heading: str) -> str:
    """The one-line bash command in the code block that follows the bold ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    match = re.search(re.escape(heading) + r".*?```bash\n(.+?)\n```", text, re.S)
    assert match, f"README.md has no ```bash block after {heading!r}"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    command = readme_command("**Tests**")
    assert command.endswith("&& pytest"), command
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(line == command or line.startswith(command + " ||") for line in ci_lines), (
        f".ci/run does not run the README's test command verbatim: {command!r}"
    )


def test_readme_main_job_runs_the_default_pipeline() -> None:
    command = readme_command("**Main job**")
    assert command.endswith("lantern pipeline configs/pipeline/default.yaml"), command
    assert (ROOT / "configs" / "pipeline" / "default.yaml").is_file()


def test_every_test_named_in_the_fault_table_exists() -> None:
    text = (ROOT / "docs" / "faults.md").read_text()
    table = text[text.index("## Faults and what Lantern does") :]
    end = table.find("\n\n", table.index("| fault |"))
    table = table if end == -1 else table[:end]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| fault", "|---"))]
    assert len(rows) >= 40, f"the fault table has {len(rows)} rows"
    for row in rows:
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", row.split("|")[-2]):
            source = (ROOT / path).read_text()
            assert name is None or name == "" or f"def {name}(" in source, (
                f"docs/faults.md fault table: {path}::{name} not found"
            )


def test_the_readmes_installs_take_the_versions_ci_tested() -> None:
    """Both README installs use constraints.txt, which pins (name==version) every distribution pyproject.toml asks
    for, base and extras, torch aside (installed first, by the README's own line)."""
    for heading in ("**Main job**", "**Tests**"):
        assert "pip install torch==2.13.0 && pip install -c constraints.txt -e " in readme_command(heading), heading
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r).group()).lower() for r in wanted}
    assert names - {"torch", "lantern"} <= set(pins), sorted(names - {"torch", "lantern"} - set(pins))
    assert "torch" not in pins


def test_check_installed_names_a_package_whose_version_is_not_its_pin(tmp_path) -> None:
    import importlib.metadata

    numpy = importlib.metadata.version("numpy")
    script = [sys.executable, str(ROOT / ".ci" / "check_installed.py")]
    (tmp_path / "same.txt").write_text(f"# comment\nnumpy=={numpy}\nnot-installed-anywhere==1.0\n")
    assert subprocess.run([*script, str(tmp_path / "same.txt")], capture_output=True, text=True).returncode == 0
    (tmp_path / "other.txt").write_text("NumPy==0.0.1\n")
    done = subprocess.run([*script, str(tmp_path / "other.txt")], capture_output=True, text=True)
    assert done.returncode == 1
    assert f"check_installed: numpy {numpy} is installed, {tmp_path / 'other.txt'} pins 0.0.1" in done.stderr
