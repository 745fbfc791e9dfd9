"""The pipeline's report: ``report.md`` (each stage's headline numbers and plots, an overview figure, every model
compared on the same held-out prompts, and their answers to the first few) and ``report.json``, the same numbers for
other tools: ``{"stages": {name: {"heldout": {"accuracy", "se", "n", "per_task"}, "kl", "seconds", ...}}}``.
It only reads what the stages left and what the held-out evaluation measured.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alignment.commands.pipeline_eval import evaluate_models
from alignment.commands.pipeline_plan_lines import plan_lines
from alignment.commands.pipeline_records import RECORD, read_json
from alignment.shared.evaluation import json_safe
from alignment.stages import registry
from data.pretrain.mixture import MIXTURE_RECORD
from models.files.atomic import write_atomically
from trainer.plan_check import RECORD as PLAN_RECORD
from trainer.plots import read_metrics_csv

if TYPE_CHECKING:  # for annotations only: alignment.commands.pipeline imports this module to write the report
    from alignment.commands.pipeline import Pipeline

Series = dict[str, list[tuple[int, float]]]


def stage_metrics(stage: str, run_dir: Path) -> Series:
    """Every metric,step,value CSV the stage's plots left (metrics.csv, accuracy.csv, kl.csv, eval.csv, ...)."""
    series: Series = {}
    for path in sorted(run_dir.glob("*.csv")):  # a stage killed mid-run may have left a torn last row: dropped
        for name, points in read_metrics_csv(path).items():
            series.setdefault(name, []).extend(points)
    return series


def _first_last(series: Series, name: str) -> str:
    points = series.get(name)
    return f"{name} {points[0][1]:.3f} → {points[-1][1]:.3f}" if points else f"{name} n/a"


def expand(names: list[str], series: Series) -> list[str]:
    """``names`` with each pattern (``val/*/loss``: a mixture's sources) replaced by the series it matches, sorted;
    a pattern that matches none is left out."""
    return [
        found
        for name in names
        for found in (sorted(n for n in series if fnmatch.fnmatchcase(n, name)) if "*" in name else [name])
    ]


def headline(stage: str, series: Series) -> str:
    """The stage's line in the report: its record's metrics, first → last (or the final value)."""
    parts = []
    for metric, note, kind in registry.stage_named(stage).headline:
        for name in expand([metric.format(stage=stage)], series):
            parts.append(_headline_part(name, note, kind, series))
    return "; ".join(parts)


def _headline_part(name: str, note: str, kind: str, series: Series) -> str:
    if kind == "final":
        points = series.get(name)
        return f"final {name} {points[-1][1]:.3f}" if points else f"{name} n/a"
    return f"{_first_last(series, name)} {note}".rstrip()


def overview_png(metrics: dict[str, Series], results: dict[str, dict[str, Any]], path: Path) -> Path:
    """2x3: each training stage's curves (quantities of another scale on a right-hand axis), and every model's
    held-out accuracy with error bars of 2 standard errors."""
    import matplotlib  # deferred, with its backend chosen first: only the report's overview draws here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [  # title, stage, (left metrics, label), (right metrics, label): the first five stages that have one
        (
            title,
            stage.name,
            *(
                (expand([m.format(stage=stage.name) for m in names], metrics.get(stage.name, {})), label)
                for names, label in axes
            ),
        )
        for stage in registry.STAGES
        if stage.panel is not None
        for title, *axes in [stage.panel]
    ][:5]
    figure, axes = plt.subplots(2, 3, figsize=(16, 8), dpi=110)
    for ax, (title, stage, left, right) in zip(axes.flat, panels):
        lines = []
        for axis, (names, label), style in ((ax, left, "-"), (ax.twinx() if right[0] else None, right, "--")):
            for name in names if axis is not None else ():
                points = metrics.get(stage, {}).get(name)
                if points:
                    color = f"C{len(lines)}"
                    marker = "o" if len(points) < 30 else None
                    lines += axis.plot(*zip(*points), style, color=color, label=name, marker=marker, markersize=3)
            if axis is not None:
                axis.set_ylabel(label)
        ax.set(title=title, xlabel=registry.stage_named(stage).x_axis)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(lines, [line.get_label() for line in lines], fontsize=8)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax = axes.flat[-1]
    names = list(results)
    if names:
        values = [results[n]["heldout"]["accuracy"] or 0.0 for n in names]  # None: nothing judged
        errors = [2 * (results[n]["heldout"]["se"] or 0.0) for n in names]
        ax.bar(names, values, yerr=errors, capsize=4, color=[f"C{i}" for i in range(len(names))])
        ax.tick_params(axis="x", labelrotation=20)
    ax.set(title="held-out accuracy (ground truth) ± 2 SE", ylabel="mean score")
    ax.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    plt.close(figure)
    return path


def _cell(text: str, limit: int = 120) -> str:
    text = " ⏎ ".join(line for line in text.strip().splitlines() if line.strip())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|") or "∅"


def _pm(value: float | None, se: float | None = None) -> str:
    if value is None or value != value:  # None or nan
        return "n/a"
    return f"{value:.3f}" if se is None else f"{value:.3f} ± {se:.3f}"


def _summary(summary: dict[str, Any] | None) -> str:
    return f"{_pm(summary['accuracy'], summary['se'])} ({summary['n']})" if summary else "—"


def _versus(versus: dict[str, Any] | None) -> str:
    return f"{_pm(versus['difference'], versus['se'])} ({versus['verdict']})" if versus else "—"


def label(stage: str) -> str:
    """A model's name in the report's tables: the pretrained (or start) model is the base."""
    return "base" if stage == "pretrain" else stage


def _task_table(title: str, results: dict[str, dict[str, Any]], key: str) -> list[str]:
    tasks = sorted({task for result in results.values() if result.get(key) for task in result[key]["per_task"]})
    if not tasks:  # nothing measured under this key (no samples)
        return []
    lines = ["", title, "", "| model | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for stage, result in results.items():
        if result.get(key):
            cells = [result[key]["per_task"].get(t) for t in tasks]
            cells_text = " | ".join(_pm(c["accuracy"], c["se"]) if c else "—" for c in cells)
            lines.append(f"| {label(stage)} | {cells_text} |")
    return lines


def harness_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Every model's lm-eval numbers (``report.harness_tasks``), each with its standard error where lm-eval has one."""
    names = list(dict.fromkeys(n for r in results.values() for n in r.get("harness", {}) if not n.endswith("_stderr")))
    if not names:
        return []
    lines = [
        "",
        "## lm-evaluation-harness tasks",
        "",
        "As `lantern eval` scores them (lm-eval's metrics ± its SE).",
        "",
    ]
    lines += ["| model | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for stage, result in results.items():
        scores = result.get("harness", {})
        cells = [_pm(scores.get(n), scores.get(f"{n}_stderr")) if n in scores else "—" for n in names]
        lines.append(f"| {label(stage)} | " + " | ".join(cells) + " |")
    return lines


def comparison_lines(
    results: dict[str, dict[str, Any]], seconds: dict[str, float | None], k: int, start: str = "SFT"
) -> list[str]:
    """The table that compares stages: every number with its standard error, a verdict only beyond 2 SE. ``start``:
    what the stages after SFT started from (their KL is to it). ``k`` 0: no samples, no sampled columns."""
    header = ["model", "greedy accuracy ± SE (n)", "vs SFT, paired ± SE"]
    header += ["sampled accuracy ± SE (n)", "vs SFT, paired ± SE", f"pass@{k} ± SE"] if k else []
    header += [f"KL to {start} (nats)", "training s"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for stage, result in results.items():
        pass_k = result.get("pass_at_k")
        cells = [label(stage), _summary(result["heldout"]), _versus(result.get("vs_sft"))]
        if k:
            cells += [_summary(result.get("sampled")), _versus(result.get("vs_sft_sampled"))]
            cells.append(_pm(pass_k["pass_at_k"], pass_k["se"]) if pass_k else "—")
        cells += [_pm(result.get("kl")), str(seconds.get(stage)) if seconds.get(stage) is not None else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    if any("vs_base" in result for result in results.values()):
        lines += ["", f"Against {start}, paired over the same prompts (± SE):", ""]
        lines += ["| model | greedy | sampled |", "|---|---|---|"] if k else ["| model | greedy |", "|---|---|"]
        lines += [
            f"| {stage} | {_versus(result.get('vs_base'))} |"
            + (f" {_versus(result.get('vs_base_sampled'))} |" if k else "")
            for stage, result in results.items()
            if "vs_base" in result
        ]
    lines += _task_table("Per task, greedy (accuracy ± SE):", results, "heldout")
    lines += _task_table(f"Per task, sampled (mean score of {k} samples at temperature 1 ± SE):", results, "sampled")
    return lines


def report_json(pipeline: Pipeline, results: dict[str, dict[str, Any]], seconds: dict[str, float | None]) -> dict:
    stages: dict[str, Any] = {}
    for stage in (s for s in pipeline.config.stages if s != "prepare"):
        result = results.get(stage)
        plan = read_json(pipeline.stage_dir(stage) / PLAN_RECORD)
        entry: dict[str, Any] = {"heldout": None, "kl": None, "seconds": seconds.get(stage), "plan": plan}
        if result is not None:
            entry.update(heldout=result["heldout"], kl=result.get("kl"))
            entry.update(
                {
                    key: result[key]
                    for key in (
                        "sampled",
                        "pass_at_k",
                        "vs_sft",
                        "vs_sft_sampled",
                        "vs_base",
                        "vs_base_sampled",
                        "harness",
                        "episodes",
                    )
                    if key in result
                }
            )
            if "transcripts" in result:
                entry["transcripts"] = str(transcripts_path(pipeline, stage))
        stages[stage] = entry
    report = pipeline.config.report
    return {"stages": stages, "checker": report.checker, "heldout_prompts": str(pipeline.demo / "prompts.jsonl")}


def write_report(pipeline: Pipeline) -> Path:
    root, report_dir, path = pipeline.root, pipeline.root / "report", pipeline.root / "report.md"
    for stale in report_dir.glob("*.png"):  # no plots left from stages that no longer exist
        stale.unlink()
    report_dir.mkdir(parents=True, exist_ok=True)
    title = (
        f"# Lantern pipeline `{pipeline.config.name}`\n\nFolder `{root}`, written {time.strftime('%Y-%m-%d %H:%M')}."
    )
    lines, plots, metrics, seconds = [title, "", "## Stages", ""], [], {}, {}
    if "prepare" in pipeline.config.stages:
        # one corpus's manifest, or a mixture's record (the same splits, summed, and each source's)
        manifest = read_json(pipeline.corpus / "manifest.json") or read_json(pipeline.corpus / MIXTURE_RECORD)
        manifest = manifest or {"splits": {}}
        tokens = ", ".join(f"{name} {split['tokens']:,} tokens" for name, split in manifest["splits"].items())
        sources = [f"{name} {s['splits']['train']['tokens']:,}" for name, s in manifest.get("sources", {}).items()]
        tokens += f" (train tokens by source: {', '.join(sources)})" if sources else ""
        demo = pipeline.config.demo
        lines.append(
            f"- **prepare** ({pipeline.status['prepare']}): corpus {tokens}; demo tasks {demo.n_train} train, {demo.n_val} val, {demo.n_pairs} pairs"
        )
    for stage in (s for s in pipeline.config.stages if s != "prepare"):
        run_dir = pipeline.stage_dir(stage)
        metrics[stage] = stage_metrics(stage, run_dir)
        seconds[stage] = (read_json(run_dir / RECORD) or {}).get("seconds")
        lines.append(
            f"- **{stage}** ({pipeline.status[stage]}, trained in {seconds[stage]}s): {headline(stage, metrics[stage])}; model `{run_dir / 'final'}`"
        )
        for png in sorted(run_dir.glob("*.png")):
            shutil.copy2(png, report_dir / f"{stage}-{png.name}")
            plots.append(f"![{stage} {png.stem}](report/{stage}-{png.name})")
    prompts, results = evaluate_models(pipeline)
    for stage, result in results.items():
        if "transcripts" in result:
            write_transcripts(transcripts_path(pipeline, stage), prompts, result)
    overview_png(metrics, results, report_dir / "overview.png")
    report = report_json(pipeline, results, seconds)
    write_atomically(root / "report.json", json.dumps(json_safe(report), indent=2) + "\n", what="report")
    if results:
        k = pipeline.config.report.pass_k
        from_start = pipeline.config.align_from == "start"
        start, reference = ("the start model", "the start model") if from_start else ("SFT", "the SFT model")
        lines += [
            "", f"## Every model on the same {len(prompts)} held-out prompts", "",
            f"Answers scored by `{pipeline.config.report.checker}` (0 to 1). Greedy: one answer per prompt at "
            "temperature 0." + (
                f" Sampled: the mean score of {k} samples per prompt at temperature 1 (pass@1 of the sampling policy, "
                f"which RL optimises), and pass@k from the same samples, on the first "
                f"{pipeline.config.report.pass_k_prompts or len(prompts)} prompts." if k else ""
            ) + " The difference from SFT is paired over the same prompts; it is called a gain or a loss only beyond "
            "2 standard errors. " + (
                f"KL: the policy's own samples, log-ratio to {reference} summed over the response."
                if not pipeline.config.report.episodes.enabled else "KL: not estimated over tool episodes."
            ) + " Also in `report.json`.", "",
            *comparison_lines(results, seconds, k, start),
            *harness_lines(results),
            *tool_lines(pipeline, results),
        ]  # fmt: skip
    lines += plan_lines(report["stages"])
    lines += ["", "## Plots", "", "![overview](report/overview.png)", "", *plots]
    if results:
        lines += answer_lines(prompts, results, pipeline.config.report.prompts)
        lines += transcript_lines(prompts, results, min(3, pipeline.config.report.prompts))
    path.write_text("\n".join(lines) + "\n")
    return path


def answer_lines(prompts: list[dict[str, Any]], results: dict[str, dict[str, Any]], count: int) -> list[str]:
    """The first ``count`` held-out prompts with each model's greedy answer and its score."""
    columns = list(results)
    lines = ["", f"## Greedy answers to {min(count, len(prompts))} of the held-out prompts", ""]
    lines.append("| # | task | prompt | reference | " + " | ".join(label(c) for c in columns) + " |")
    lines.append("|---" * (4 + len(columns)) + "|")
    for i, prompt in enumerate(prompts[:count]):
        record = prompt["record"]
        cells = []
        for c in columns:
            score = results[c]["scores"][i]
            cells.append(f"{_cell(results[c]['answers'][i], 80)} ({'n/a' if score is None else f'{score:.2f}'})")
        question = record["messages"][-1]["content"] if record.get("messages") else str(record.get("prompt", ""))
        reference = prompt.get("reference") or ""
        lines.append(
            f"| {i + 1} | {record.get('task', '')} | {_cell(question)} | {_cell(reference, 80)} | {' | '.join(cells)} |"
        )
    return lines


def transcripts_path(pipeline: Pipeline, stage: str) -> Path:
    return pipeline.root / "report" / f"transcripts-{stage}.jsonl"


def write_transcripts(path: Path, prompts: list[dict[str, Any]], result: dict[str, Any]) -> None:
    """One JSON line per held-out prompt: its task, the episode's messages, how it ended, its calls and its score."""
    rows = (
        {"index": i, "task": prompt["record"].get("task", ""), **episode, "answer": answer, "score": score}
        for i, (prompt, episode, answer, score) in enumerate(
            zip(prompts, result["transcripts"], result["answers"], result["scores"])
        )
    )
    text = "".join(json.dumps(json_safe(row)) + "\n" for row in rows)
    write_atomically(path, text, what="episode transcripts")


def tool_lines(pipeline: Pipeline, results: dict[str, dict[str, Any]]) -> list[str]:
    """Each model's tool use over its held-out episodes (``report.episodes``): means per episode."""
    rows = [(stage, result["episodes"]) for stage, result in results.items() if "episodes" in result]
    if not rows:
        return []
    lines = [
        "", "## Tool use", "",
        f"Every model answered in episodes with the tools of `{pipeline.config.report.episodes.environment}` (at most "
        f"{pipeline.config.report.episodes.max_turns} turns). Means per episode; a malformed call is one the model "
        "wrote but the parser could not read, answered with an error. Every episode is in `report/transcripts-STAGE.jsonl`.",
        "", "| model | turns | tool calls | malformed calls | tokens | ended by answer | by turn limit | by token limit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for stage, stats in rows:
        lines.append(
            f"| {label(stage)} | {stats['turns']:.2f} | {stats['tool_calls']:.2f} | {stats['malformed_calls']:.2f} | "
            f"{stats['episode_tokens']:.0f} | {stats['ended_answer']:.2f} | {stats['ended_turns']:.2f} | "
            f"{stats['ended_tokens']:.2f} |"
        )
    return lines


def transcript_lines(prompts: list[dict[str, Any]], results: dict[str, dict[str, Any]], count: int) -> list[str]:
    """The first ``count`` held-out prompts' episodes, each model's turns after the first messages."""
    stages = [stage for stage, result in results.items() if "transcripts" in result]
    if not stages or not count:
        return []
    lines = ["", f"## Episodes on {min(count, len(prompts))} of the held-out prompts", ""]
    for i, prompt in enumerate(prompts[:count]):
        lines += [f"Prompt {i + 1}: {_cell(prompt['messages'][-1]['content'])}", ""]
        for stage in stages:
            episode, score = results[stage]["transcripts"][i], results[stage]["scores"][i]
            turns = episode["messages"][episode["opening"] :]
            lines += [f"{label(stage)} (ended by {episode['ended']}, score {_pm(score)}):", "", "```"]
            lines += [f"{m['role']}: {m['content'].strip()}" for m in turns] + ["```", ""]
    return lines
