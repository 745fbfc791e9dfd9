"""The one table ``benchmarks/gpu_check.sh`` ends with: every step's status and time, then MFU, tokens/s and peak
memory of the pretraining benchmarks (``bench_pretrain.py --json``) and the generation benchmark
(``bench_generation.py --json``), read from the JSON files in the check's output folder.

    python -m benchmarks.gpu_table OUT_DIR        # prints the markdown table and writes OUT_DIR/table.md

Files read (each optional; a missing or unreadable one is a row saying so, never a crash):
``env.json`` (date, GPU, torch), ``steps.tsv`` (``step<TAB>exit status<TAB>seconds<TAB>log``, one line a step),
``pytest.xml`` (JUnit counts), ``pretrain*.json``, ``generation.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TPS_KEYS = ("tokens_per_second", "cache_tokens_per_second", "kv_cache_tokens_per_second", "tok_s")
MEMORY_KEYS = ("peak_memory_gib", "max_memory_gib", "peak_gib")


def _load(path: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as error:
        return None, f"{path.name}: {error}"


def _number(value: Any, spec: str, suffix: str = "") -> str:
    return f"{value:{spec}}{suffix}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "–"


def _first(record: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((record[key] for key in keys if key in record), None)


def step_rows(out: Path) -> list[list[str]]:
    path = out / "steps.tsv"
    if not path.is_file():
        return [["(no steps.tsv)", "–", "–", "–"]]
    rows = []
    with open(path, newline="") as handle:
        for fields in csv.reader(handle, delimiter="\t"):
            if len(fields) < 3:
                continue
            step, status, seconds = fields[:3]
            result = "ok" if status == "0" else ("skipped" if status == "skip" else f"FAILED (exit {status})")
            detail = pytest_summary(out / "pytest.xml") if step == "tests" else (fields[3] if len(fields) > 3 else "")
            rows.append([step, result, _number(float(seconds), ".0f", " s") if seconds else "–", detail])
    return rows


def pytest_summary(path: Path) -> str:
    """passed / failed / skipped from pytest's JUnit XML (one <testsuite>, or several under <testsuites>)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return "no pytest.xml"
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return f"{passed} passed, {total['failures'] + total['errors']} failed, {total['skipped']} skipped"


def pretrain_rows(data: dict[str, Any], name: str) -> list[list[str]]:
    label = f"{data.get('preset', name)} seq {data.get('seq_len')} x {data.get('micro_batch')}"
    if data.get("mode") == "fsdp-ac":
        label += ", FSDP2 + AC"
    rows = []
    for result in data.get("results", []):
        mfu = _number(result.get("mfu"), ".1%")
        if "hfu_with_recomputation" in result:
            mfu += f" (HFU {_number(result['hfu_with_recomputation'], '.1%')})"
        vs_hf = _number(result.get("vs_hf"), ".2f", "x")
        masking = "doc mask" if result.get("document_masking") else "causal"
        notes = [f"vs HF {vs_hf}"] if result.get("vs_hf") is not None and result.get("contender") != "hf" else []
        notes += plan_note(result)
        rows.append([
            f"pretrain {label}: {result.get('contender')} ({result.get('precision')}, {masking})",
            mfu, _number(result.get("tokens_per_second"), ",.0f"), _number(result.get("peak_memory_gib"), ".1f"),
            "; ".join(notes),
        ])  # fmt: skip
    return rows


def plan_note(result: dict[str, Any]) -> list[str]:
    """`lantern plan`'s predicted peak beside the measured one (the Lightning path's: what a stage runs)."""
    planned, measured = result.get("planned_peak_gib"), result.get("peak_memory_gib")
    if not isinstance(planned, (int, float)):
        return []
    if not isinstance(measured, (int, float)) or not planned:
        return [f"plan {planned:.1f} GiB (not measured here)"]
    return [f"plan {planned:.1f} GiB, measured {measured / planned - 1:+.0%} from it"]


def generation_rows(data: Any) -> list[list[str]]:
    """One row per measured batch size: any record (at any depth) with a batch size and a tokens/s field."""
    rows: list[list[str]] = []

    def visit(node: Any, context: dict[str, Any]) -> None:
        if isinstance(node, dict):
            context = {**context, **{k: v for k, v in node.items() if not isinstance(v, (dict, list))}}
            batch = _first(node, ("batch_size", "batch"))
            if batch is not None and _first(node, TPS_KEYS) is not None:
                mode = f" {node['mode']}" if "mode" in node else ""
                speedup = next(((k, v) for k, v in node.items() if k.startswith("speedup_vs_")), None)
                rows.append([
                    f"generation {context.get('preset', '')} {context.get('dtype', '')} batch {batch}{mode}".replace("  ", " "),
                    "", _number(_first(node, TPS_KEYS), ",.1f"), _number(_first(node, MEMORY_KEYS), ".1f"),
                    f"{_number(speedup[1], '.2f', 'x')} vs {speedup[0][len('speedup_vs_'):]}" if speedup else "",
                ])  # fmt: skip
                return
            for value in node.values():
                visit(value, context)
        elif isinstance(node, list):
            for value in node:
                visit(value, context)

    visit(data, {})
    return rows or [["generation", "", "–", "–", "no per-batch results in generation.json"]]


def render(out: Path) -> str:
    env, _ = _load(out / "env.json") if (out / "env.json").is_file() else ({}, None)
    env = env or {}
    lines = [
        f"## GPU check: {env.get('date', '?')}",
        "",
        f"{env.get('gpu', '?')}; torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}; mode {env.get('mode', '?')}; "
        f"commit {env.get('commit', '?')}",
        "",
        "| step | result | time | detail |",
        "|---|---|---:|---|",
        *(f"| {' | '.join(row)} |" for row in step_rows(out)),
        "",
        "| measurement | MFU | tokens/s | peak memory GiB | note |",
        "|---|---:|---:|---:|---|",
    ]
    peaks = set()
    for path in sorted(out.glob("pretrain*.json")):
        data, error = _load(path)
        rows = [[path.name, "–", "–", "–", error]] if error else pretrain_rows(data, path.stem)
        peaks |= {_number(r["peak_flops"] / 1e12, ".3g") for r in (data or {}).get("results", []) if "peak_flops" in r}
        lines += [f"| {' | '.join(row)} |" for row in rows]
    if (out / "generation.json").is_file():
        data, error = _load(out / "generation.json")
        rows = [["generation", "–", "–", "–", error]] if error else generation_rows(data)
        lines += [f"| {' | '.join(row)} |" for row in rows]
    lines += [
        "",
        "MFU: model FLOPs (6N + 12·L·d·T per token, no activation recomputation) over the peak "
        f"({', '.join(sorted(peaks)) or '?'} TFLOP/s); HFU also counts the recomputed forwards; vs HF: "
        "tokens/s over Hugging Face in the same run (compiled when the config compiles); peak memory: torch.cuda.max_memory_allocated; "
        "plan: the peak `lantern plan` predicts for the Lightning run's config on this GPU (docs/plan.md)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="the gpu_check.sh output folder")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    if not out.is_dir():
        parser.error(f"{out} is not a folder")
    table = render(out)
    (out / "table.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
