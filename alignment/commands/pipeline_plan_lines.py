"""The pipeline report's section that holds each stage against its plan: ``lantern plan``'s peak memory and step
time beside what the run measured (the stage's ``plan_vs_measured.json``)."""

from __future__ import annotations

from typing import Any

from models.memory import GiB


def plan_lines(stages: dict[str, Any]) -> list[str]:
    """Each stage held against its plan (``report_json``'s ``plan``, its ``plan_vs_measured.json``): peak memory and
    step time, planned and measured."""
    rows = []
    for stage, entry in stages.items():
        record = entry["plan"]
        if record is None:
            continue
        planned, measured = (_seconds(record[key]) for key in ("step_s", "measured_step_s"))
        rows.append(
            f"| {stage} | {record['peak_bytes'] / GiB:.2f} | {_gib(record['measured_peak_bytes'])} | "
            f"{_ratio(record['peak_ratio'])} | {planned} | {measured} | {_ratio(record['step_ratio'])} | "
            f"{record['memory_measured_as']} |"
        )
    if not rows:
        return []
    return [
        "", "## Each stage against its plan", "",
        "`lantern plan`'s figures for the device each stage ran on, beside what the run measured "
        "(`plan_vs_measured.json` in its folder; a CPU plan has no step time).", "",
        "| stage | planned peak GiB | measured GiB | measured / planned | planned step s | measured step s | "
        "measured / planned | memory measured as |",
        "|---|---:|---:|---:|---:|---:|---:|---|", *rows,
    ]  # fmt: skip


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _gib(value: float | None) -> str:
    return "—" if value is None else f"{value / GiB:.2f}"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"
