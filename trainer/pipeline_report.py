"""The pipeline's report: ``report.md`` in the pipeline folder, with each stage's headline numbers, its plots
(copied to ``report/``) and an overview figure, and a table of greedy answers by each trained model to held-out
demo prompts (cached in ``report/answers.json`` while the models and prompts are unchanged). It only reads what
the stages left; running them is ``trainer/pipeline.py``'s job.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from alignment.evaluation import answer_prompts
from data.demo_scoring import score_example
from data.demo_tasks import load_jsonl
from data.tokenizer import Tokenizer
from models.checkpoint import load_checkpoint
from trainer.pipeline_records import RECORD, read_json, sha
from trainer.plots import read_metrics_csv
from trainer.storage import latest_checkpoint

if TYPE_CHECKING:  # for annotations only: trainer.pipeline imports this module to write the report
    from trainer.pipeline import Pipeline

Series = dict[str, list[tuple[int, float]]]
TABLE_MODELS = {"base": "pretrain", "sft": "sft", "ppo": "ppo"}  # column -> the stage whose final/ answers


def stage_metrics(stage: str, run_dir: Path) -> Series:
    """Every metric,step,value CSV the stage's plots left (metrics.csv, accuracy.csv, kl.csv, ...), plus PPO's
    evaluation history, which only its checkpoints keep."""
    series: Series = {}
    for path in sorted(run_dir.glob("*.csv")):  # a stage killed mid-run may have left a torn last row: dropped
        for name, points in read_metrics_csv(path).items():
            series.setdefault(name, []).extend(points)
    if stage == "ppo":
        checkpoint = latest_checkpoint(run_dir / "checkpoints")
        if checkpoint is not None:
            state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
            series.update(
                {
                    k: [(int(s), float(v)) for s, v in points]
                    for k, points in state.get("ppo", {}).get("eval_history", {}).items()
                }
            )
    return series


def _first_last(series: Series, name: str) -> str:
    points = series.get(name)
    return f"{name} {points[0][1]:.3f} → {points[-1][1]:.3f}" if points else f"{name} n/a"


def headline(stage: str, series: Series) -> str:
    if stage == "pretrain":
        return _first_last(series, "val/loss")
    if stage == "sft":
        return f"{_first_last(series, 'val/loss')}; {_first_last(series, 'val/accuracy')} (exact match)"
    if stage == "rm":
        return f"{_first_last(series, 'val/accuracy')} (pairwise, held-out pairs)"
    kl = series.get("ppo/kl")
    final_kl = f"final ppo/kl {kl[-1][1]:.3f}" if kl else "ppo/kl n/a"
    return f"{_first_last(series, 'eval/gt_score')}; {_first_last(series, 'eval/rm_score')}; {final_kl}"


def overview_png(metrics: dict[str, Series], path: Path) -> Path:
    """2x2: each stage's held-out measure; quantities of another scale go on a right-hand axis."""
    import matplotlib  # deferred, with its backend chosen first: only the report's overview draws here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [  # title, stage, (left metrics, label), (right metrics, label)
        ("pretraining", "pretrain", (("train/loss", "val/loss"), "loss"), ((), "")),
        ("SFT", "sft", (("train/loss", "val/loss"), "loss"), (("val/accuracy",), "exact-match accuracy")),
        ("reward model", "rm", (("train/accuracy", "val/accuracy"), "pairwise accuracy"), ((), "")),
        (
            "PPO: greedy answers to held-out prompts",
            "ppo",
            (("eval/gt_score", "eval/rm_score"), "score"),
            (("ppo/kl",), "KL to the SFT model (nats)"),
        ),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(12, 8), dpi=110)
    for ax, (title, stage, left, right) in zip(axes.flat, panels):
        lines = []
        for axis, (names, label), style in ((ax, left, "-"), (ax.twinx() if right[0] else None, right, "--")):
            for name in names if axis is not None else ():
                points = metrics.get(stage, {}).get(name)
                if points:
                    color = f"C{len(lines)}"
                    lines += axis.plot(
                        *zip(*points),
                        style,
                        color=color,
                        label=name,
                        marker="o" if len(points) < 30 else None,
                        markersize=3,
                    )
            if axis is not None:
                axis.set_ylabel(label)
        ax.set(title=title, xlabel="rollout" if stage == "ppo" else "optimizer step")
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(lines, [line.get_label() for line in lines], fontsize=8)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    plt.close(figure)
    return path


def answer_table(pipeline: Pipeline, cache_path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The first report.prompts records of prompts.jsonl (the demo's val split: never trained on by SFT or the
    RM, and PPO holds out the first val_fraction of them) answered greedily by each model that exists."""
    records = load_jsonl(pipeline.demo / "prompts.jsonl")[: pipeline.config.report.prompts]
    spec = next(
        (pipeline.configs[s].data.tokenizer for s in ("sft", "ppo", "rm", "pretrain") if s in pipeline.configs),
        "default",
    )
    models = {column: pipeline.upstream(stage) for column, stage in TABLE_MODELS.items()}
    models = {column: path for column, (path, _) in models.items() if path is not None and path.is_dir()}
    if not models:
        return [], []
    # Same models (by stage hash), prompts and settings as last time: reuse the answers, re-runs stay fast.
    key = sha(
        json.dumps(
            [
                spec,
                pipeline.demo_hash,
                str(pipeline.config.report),
                [(c, pipeline.upstream(TABLE_MODELS[c])[1]) for c in models],
            ]
        )
    )
    if (cache := read_json(cache_path)) and cache.get("key") == key:
        return cache["columns"], cache["rows"]
    tokenizer = Tokenizer.load(spec)
    prompt_ids = [tokenizer.encode_chat_prompt(r["messages"]) for r in records]
    rows = [
        {
            "task": r["task"],
            "prompt": r["messages"][-1]["content"],
            "reference": r.get("answer", ""),
            "answers": {},
            "scores": {},
        }
        for r in records
    ]
    with tqdm(total=len(models) * len(records), desc="report: greedy answers", unit="prompt") as progress:
        for column, path in models.items():
            model = load_checkpoint(path).eval()
            budget = max(
                1,
                min(
                    pipeline.config.report.max_new_tokens,
                    model.config.max_seq_len - max(map(len, prompt_ids), default=0),
                ),
            )
            for start in range(0, len(records), 8):  # small batches: the bar moves
                answers = answer_prompts(model, tokenizer, prompt_ids[start : start + 8], max_new_tokens=budget)
                for row, record, answer in zip(rows[start:], records[start:], answers):
                    row["answers"][column], row["scores"][column] = answer, score_example(record, answer)
                progress.update(len(answers))
    cache_path.write_text(json.dumps({"key": key, "columns": list(models), "rows": rows}, indent=1) + "\n")
    return list(models), rows


def _cell(text: str, limit: int = 120) -> str:
    text = " ⏎ ".join(line for line in text.strip().splitlines() if line.strip())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|") or "∅"


def write_report(pipeline: Pipeline) -> Path:
    root, report_dir, path = pipeline.root, pipeline.root / "report", pipeline.root / "report.md"
    for stale in report_dir.glob("*.png"):  # no plots left from stages that no longer exist
        stale.unlink()
    report_dir.mkdir(parents=True, exist_ok=True)
    title = (
        f"# Lantern pipeline `{pipeline.config.name}`\n\nFolder `{root}`, written {time.strftime('%Y-%m-%d %H:%M')}."
    )
    lines, plots, metrics = [title, "", "## Stages", ""], [], {}
    if "prepare" in pipeline.config.stages:
        manifest = read_json(pipeline.corpus / "manifest.json") or {"splits": {}}
        tokens = ", ".join(f"{name} {split['tokens']:,} tokens" for name, split in manifest["splits"].items())
        demo = pipeline.config.demo
        lines.append(
            f"- **prepare** ({pipeline.status['prepare']}): corpus {tokens}; demo tasks {demo.n_train} train, {demo.n_val} val, {demo.n_pairs} pairs"
        )
    for stage in (s for s in pipeline.config.stages if s != "prepare"):
        run_dir = pipeline.stage_dir(stage)
        metrics[stage] = stage_metrics(stage, run_dir)
        seconds = (read_json(run_dir / RECORD) or {}).get("seconds")
        lines.append(
            f"- **{stage}** ({pipeline.status[stage]}, trained in {seconds}s): {headline(stage, metrics[stage])}; model `{run_dir / 'final'}`"
        )
        for png in sorted(run_dir.glob("*.png")):
            shutil.copy2(png, report_dir / f"{stage}-{png.name}")
            plots.append(f"![{stage} {png.stem}](report/{stage}-{png.name})")
    overview_png(metrics, report_dir / "overview.png")
    lines += ["", "## Plots", "", "![overview](report/overview.png)", "", *plots]

    columns, rows = answer_table(pipeline, report_dir / "answers.json")
    if not columns:
        path.write_text("\n".join(lines) + "\n")
        return path
    lines += [
        "",
        f"## Greedy answers to {len(rows)} held-out prompts",
        "",
        "Score: the task's ground-truth checker, 0 to 1.",
        "",
    ]
    lines.append("| # | task | prompt | reference | " + " | ".join(columns) + " |")
    lines.append("|---" * (4 + len(columns)) + "|")
    for i, row in enumerate(rows, start=1):
        answers = " | ".join(f"{_cell(row['answers'][c], 80)} ({row['scores'][c]:.2f})" for c in columns)
        lines.append(f"| {i} | {row['task']} | {_cell(row['prompt'])} | {_cell(row['reference'], 80)} | {answers} |")
    means = " | ".join(f"**{sum(r['scores'][c] for r in rows) / max(len(rows), 1):.3f}**" for c in columns)
    lines.append(f"| | **mean score** | | | {means} |")
    path.write_text("\n".join(lines) + "\n")
    return path
