"""``lantern plan`` held against published GPU runs: for each run in ``benchmarks/published_runs.json`` (torchtitan,
LitGPT, torchtune and OLMo-core figures, each with its source link, quote and the ``lantern plan`` arguments that
express its settings), plan it in-process, set the plan's peak memory, throughput and verdict beside the published
ones, and print a markdown table, then the summary the planner is held to: over the runs whose settings Lantern
expresses, the median and extremes of plan / published for memory and throughput, and whether every published OOM
(and every run that did not OOM) was called right. Runs Lantern cannot express (float8, tensor or pipeline
parallelism, QLoRA, 8-bit or paged optimizers, ...) are planned at their nearest setting and shown, marked, but left
out of the goals. The rows and the summary are written to ``benchmarks/results/plan_vs_published.json``.

    python -m benchmarks.plan_vs_published [--markdown] [--only ID_SUBSTRING] [--docs]

Run from the repository root (the plan arguments name configs by their path from there). ``--markdown`` prints
only the table and summary (no progress lines); ``--docs`` also writes them into docs/plan.md, between its
``plan_vs_published`` markers (tests/test_benchmarks.py holds the expressed rows there to the planner's).
Estimates against measurements taken by others on their hardware: a ratio above 1 means the plan says more than was
published.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.plan_tables import plan_output

HERE = Path(__file__).resolve().parent
RUNS = HERE / "published_runs.json"
RESULTS = HERE / "results" / "plan_vs_published.json"
DOCS = HERE.parent / "docs" / "plan.md"
BEGIN, END = "<!-- plan_vs_published: begin -->", "<!-- plan_vs_published: end -->"

# the goals, over the runs Lantern expresses
MEMORY_MEDIAN = (0.95, 1.10)
MEMORY_WORST = 1.30  # plan / published, either way: max(r, 1 / r)
THROUGHPUT_MEDIAN = (0.90, 1.10)


def plan(args: list[str]) -> dict[str, Any]:
    """``lantern plan ARGS --json``, its JSON parsed."""
    return json.loads(plan_output(*args, "--json"))


def ratio(planned: float | None, published: float | None) -> float | None:
    return planned / published if planned is not None and published else None


def compare(run: dict[str, Any]) -> dict[str, Any]:
    """One run: the plan's figures, the ratios and the OOM call, and the plan's memory items (for diagnosis)."""
    result = plan(run["plan_args"])
    published = run["published"]
    tokens = (result.get("time") or {}).get("tokens_per_s_per_gpu")
    said_oom = result["verdict"] == "does not fit"
    return {
        "id": run["id"],
        "expresses": run["expresses"],
        "mfu_calibration": run.get("mfu_calibration", False),
        "published": published,
        "plan": {
            "peak_gib": result["peak_gib"],
            "capacity_gib": result["capacity_bytes"] / 2**30,
            "verdict": result["verdict"],
            "tokens_per_s_per_gpu": tokens,
            "mfu": (result.get("time") or {}).get("mfu"),
            # every item of every phase, in GiB: what the diagnosis of a gap reads
            "phases": {
                phase["name"]: {item["name"]: round(item["gib"], 3) for item in phase["items"]}
                for phase in result["phases"]
            },
        },
        "memory_ratio": ratio(result["peak_gib"], published["peak_memory_gib"]),
        # a run the plan says does not fit is still given a throughput: compare it only where the run ran
        "throughput_ratio": None if published["oom"] else ratio(tokens, published["tokens_per_s_per_gpu"]),
        "oom_right": said_oom == bool(published["oom"]),
    }


def kind(memory_kind: str | None) -> str:
    """The published memory's allocator statistic, in a word (the plan's figure is closest to peak allocated)."""
    text = (memory_kind or "").lower()
    for word in ("reserved", "active", "allocated"):
        if word in text:
            return word
    return "unspecified" if text else ""


def number(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def table(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | settings | published GiB (kind) | plan GiB | ratio | published tok/s/GPU | plan tok/s/GPU | ratio "
        "| OOM: published / plan | expressed? gap |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    lines += [row_line(run, row) for run, row in zip(runs, rows)]
    return "\n".join(lines)


def row_line(run: dict[str, Any], row: dict[str, Any]) -> str:
    """One run's row of the table: its link, settings, published and planned figures, ratios and OOM call."""
    published, planned = row["published"], row["plan"]
    memory = published["peak_memory_gib"]
    memory_text = f"{memory:.1f} ({kind(published['memory_kind'])})" if memory is not None else "–"
    oom = f"{'OOM' if published['oom'] else 'ran'} / {planned['verdict']}" + ("" if row["oom_right"] else " ✗")
    gap = "yes" if run["expresses"] else f"**no**: {run['gap']}"
    if run["expresses"] and run["gap"]:
        gap += f" ({run['gap']})"
    if row["mfu_calibration"]:
        gap += "; the planner's MFU figure is taken from this run"
    return (
        f"| [{run['id']}]({run['source_url']}) | {run['settings']} | {memory_text} | {planned['peak_gib']:.1f} "
        f"| {number(row['memory_ratio'], 2)} | {number(published['tokens_per_s_per_gpu'], 0)} "
        f"| {number(planned['tokens_per_s_per_gpu'], 0)} | {number(row['throughput_ratio'], 2)} | {oom} | {gap} |"
    )


def docs_block(runs: list[dict[str, Any]], rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """What docs/plan.md shows between its markers: the runs Lantern expresses, the summary, then the others folded."""
    expressed = [(run, row) for run, row in zip(runs, rows) if run["expresses"]]
    others = [(run, row) for run, row in zip(runs, rows) if not run["expresses"]]
    return "\n".join([
        BEGIN,
        table(*map(list, zip(*expressed))),
        "",
        summary_text(summary),
        "",
        f"<details><summary>The {len(others)} runs Lantern does not express (planned at the nearest setting, shown, "
        "left out of the goals)</summary>",
        "",
        table(*map(list, zip(*others))),
        "",
        "</details>",
        END,
    ])  # fmt: skip


def write_docs(block: str) -> None:
    """Replace what lies between the markers in docs/plan.md (one line saying so if they are not there)."""
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOCS}: no '{BEGIN}' ... '{END}' markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    DOCS.write_text(head + block + rest.split(END, 1)[1])


def spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals' figures over the expressed runs; throughput also without the runs the MFU table was fitted to
    (planning those gives back their own figure by construction)."""
    expressed = [row for row in rows if row["expresses"]]
    memory = [row["memory_ratio"] for row in expressed if row["memory_ratio"] is not None]
    throughput = [row for row in expressed if row["throughput_ratio"] is not None]
    wrong = [row["id"] for row in expressed if not row["oom_right"]]
    summary = {
        "memory_ratio": spread(memory),
        "throughput_ratio": spread([row["throughput_ratio"] for row in throughput]),
        "throughput_ratio_without_mfu_sources": spread(
            [row["throughput_ratio"] for row in throughput if not row["mfu_calibration"]]
        ),
        "oom_calls": {
            "published_oom": sum(1 for row in expressed if row["published"]["oom"]),
            "right": len(expressed) - len(wrong),
            "wrong": wrong,
        },
        "oom_calls_not_expressed_wrong": [row["id"] for row in rows if not row["expresses"] and not row["oom_right"]],
    }
    memory_stats, throughput_stats = summary["memory_ratio"], summary["throughput_ratio"]
    summary["goals"] = {
        "memory_median": bool(memory) and MEMORY_MEDIAN[0] <= memory_stats["median"] <= MEMORY_MEDIAN[1],
        "memory_worst": bool(memory) and max(max(memory), 1 / min(memory)) <= MEMORY_WORST,
        "throughput_median": bool(throughput)
        and THROUGHPUT_MEDIAN[0] <= throughput_stats["median"] <= THROUGHPUT_MEDIAN[1],
        "oom_calls": not wrong,
    }
    return summary


def summary_text(summary: dict[str, Any]) -> str:
    def line(label: str, stats: dict[str, Any]) -> str:
        if not stats["n"]:
            return f"- {label}: no runs"
        return (
            f"- {label} ({stats['n']} runs): median {stats['median']:.2f}, "
            f"min {stats['min']:.2f}, max {stats['max']:.2f}"
        )

    goals, calls = summary["goals"], summary["oom_calls"]
    wrong = ", ".join(calls["wrong"]) or "none"
    lines = [
        "Over the runs Lantern expresses (plan / published):",
        line("memory", summary["memory_ratio"]),
        line("throughput", summary["throughput_ratio"]),
        line(
            "throughput, without the runs the MFU table is taken from", summary["throughput_ratio_without_mfu_sources"]
        ),
        f"- OOM calls: {calls['right']} of {calls['right'] + len(calls['wrong'])} right (the set has "
        f"{calls['published_oom']} published OOMs); wrong: {wrong}",
        f"- not expressed, OOM called wrong: {', '.join(summary['oom_calls_not_expressed_wrong']) or 'none'}",
        f"Goals: memory median in {MEMORY_MEDIAN[0]}–{MEMORY_MEDIAN[1]}: {'met' if goals['memory_median'] else 'NOT met'}; "
        f"worst within {MEMORY_WORST}x either way: {'met' if goals['memory_worst'] else 'NOT met'}; "
        f"throughput median in {THROUGHPUT_MEDIAN[0]}–{THROUGHPUT_MEDIAN[1]}: "
        f"{'met' if goals['throughput_median'] else 'NOT met'}; every OOM called right: "
        f"{'met' if goals['oom_calls'] else 'NOT met'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print only the table and the summary")
    parser.add_argument("--only", default="", help="plan only the runs whose id contains this")
    parser.add_argument("--docs", action="store_true", help="also write the table into docs/plan.md")
    args = parser.parse_args(argv)
    if args.docs and args.only:
        parser.error("--docs writes the whole table: not with --only")
    runs = [run for run in json.loads(RUNS.read_text()) if args.only in run["id"]]
    rows = []
    for run in runs:
        if not args.markdown:
            print(f"planning {run['id']}", file=sys.stderr)
        rows.append(compare(run))
    summary = summarise(rows)
    print(table(runs, rows) + "\n\n" + summary_text(summary))
    if not args.only:  # a partial run does not replace the whole table's results
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"runs": rows, "summary": summary}, indent=1, ensure_ascii=False) + "\n")
    if args.docs:
        write_docs(docs_block(runs, rows, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
