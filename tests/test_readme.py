"""The README's commands are the ones CI runs: its test command appears in `.ci/run` character for character; and
every test the fault table in `docs/faults.md` names exists."""

from __future__ import annotations

import re
from pathlib import Path

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
