"""The whole recipe in one command: prepare → pretrain → SFT → reward model → PPO, then a report.

Each stage is the ordinary stage (``run_pretrain``, ``run_sft``, ...) on its own preset plus overrides; the
pipeline only appends the wiring overrides (folders, the previous stage's ``final/``, the demo data, one shared
logger) after the stage's own ones, so the pipeline always wins on wiring and the user on everything else.

Re-runs are incremental. A finished stage leaves ``pipeline_stage.json`` holding a hash of its fully resolved
config and of its inputs' hashes, so the hashes chain: an unchanged stage is skipped, a changed one re-runs
from scratch (its old folder moved to ``<stage>.previous``) and so does everything after it. A stage that was
interrupted (``pipeline_stage.pending.json`` with the same hash, no record) resumes from its own checkpoints.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from models.errors import ConfigError
from trainer.config import PPOConfig, PretrainConfig, RMConfig, SFTConfig, load_config, to_yaml

log = logging.getLogger("lantern.pipeline")

STAGES = ("prepare", "pretrain", "sft", "rm", "ppo")
RECORD, PENDING = "pipeline_stage.json", "pipeline_stage.pending.json"


@dataclass
class StageSection:
    config: str = ""  # the stage's preset YAML
    overrides: list[str] = field(default_factory=list)  # key=value, applied before the pipeline's wiring


@dataclass
class DemoDataSection:
    n_train: int = 4000
    n_val: int = 400
    n_pairs: int = 2000
    seed: int = 0


@dataclass
class PipelineLoggerSection:
    kind: Literal["wandb", "csv", "none"] = "wandb"
    project: str = "lantern"
    mode: Literal["auto", "offline", "online"] = "auto"


@dataclass
class ReportSection:
    prompts: int = 16  # held-out demo prompts answered greedily by each model in report.md
    max_new_tokens: int = 64


@dataclass
class PipelineConfig:
    name: str = "pipeline"
    out_dir: str | None = None  # None: runs/pipeline-NAME
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    start_checkpoint: str | None = None  # the model a stage starts from when the stage before it is not run
    seed: int | None = None  # run.seed of every model stage; None: each stage preset's own seed
    demo: DemoDataSection = field(default_factory=DemoDataSection)
    logger: PipelineLoggerSection = field(default_factory=PipelineLoggerSection)
    pretrain: StageSection = field(default_factory=lambda: StageSection("configs/pretrain/tiny.yaml"))
    sft: StageSection = field(default_factory=lambda: StageSection("configs/sft/tiny.yaml"))
    rm: StageSection = field(default_factory=lambda: StageSection("configs/rm/tiny.yaml"))
    ppo: StageSection = field(default_factory=lambda: StageSection("configs/ppo/tiny.yaml"))
    report: ReportSection = field(default_factory=ReportSection)


# stage -> (schema, {config key: the upstream stage whose final/ it receives})
MODEL_STAGES: dict[str, tuple[type, dict[str, str]]] = {
    "pretrain": (PretrainConfig, {}),
    "sft": (SFTConfig, {"init.checkpoint": "pretrain"}),
    "rm": (RMConfig, {"init.checkpoint": "sft"}),
    "ppo": (PPOConfig, {"init.policy": "sft", "init.reward_model": "rm"}),
}
DEMO_FILES = {
    "sft": {"data.train": "train", "data.val": "val"},
    "rm": {"data.train": "pairs"},
    "ppo": {"data.train": "prompts"},
}


def _sha(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _data_hash(manifest: dict[str, Any]) -> str:
    return _sha(json.dumps(manifest, sort_keys=True))  # the manifest names inputs (sha256), tokenizer, settings


def _folder_fingerprint(path: Path) -> str:
    """Names, sizes and mtimes: enough to notice a replaced start checkpoint without hashing gigabytes."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    return _sha(
        str(path.resolve()), *(f"{p.relative_to(path)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    )


class Pipeline:
    def __init__(self, config: PipelineConfig) -> None:
        unknown = [s for s in config.stages if s not in STAGES]
        if (
            unknown
            or config.stages != sorted(config.stages, key=STAGES.index)
            or len(set(config.stages)) != len(config.stages)
        ):
            raise ConfigError(f"stages must be a subset of {list(STAGES)} in that order, got {config.stages}")
        self.config = config
        self.root = Path(config.out_dir or f"runs/pipeline-{config.name}")
        self.corpus, self.demo = self.root / "data" / "corpus", self.root / "data" / "demo"
        self.outputs: dict[str, tuple[Path, str]] = {}  # stage -> (final folder or data folder, hash), this run
        self.configs: dict[str, Any] = {}  # stage -> its loaded config
        self.status: dict[str, str] = {}  # stage -> ran | resumed | skipped, for the report

    def stage_dir(self, stage: str) -> Path:
        return self.root / "data" if stage == "prepare" else self.root / stage

    def load_stage_config(self, stage: str) -> tuple[Any, dict[str, str]]:
        """The stage's preset + its overrides + the wiring, and the hashes of everything it reads."""
        schema, upstream = MODEL_STAGES["pretrain" if stage == "prepare" else stage]
        section: StageSection = getattr(self.config, "pretrain" if stage == "prepare" else stage)
        logger = self.config.logger
        wiring: dict[str, Any] = {
            "run.out_dir": str(self.root), "run.name": stage, "logger.kind": logger.kind,
            "logger.project": logger.project, "logger.mode": logger.mode, "logger.group": self.config.name,
        }  # fmt: skip
        if stage in ("prepare", "pretrain"):
            wiring["data.out_dir"] = str(self.corpus)
        if self.config.seed is not None and stage != "prepare":
            wiring["run.seed"] = self.config.seed
        inputs: dict[str, str] = {}
        for key, source in upstream.items():
            path, inputs[source] = self.upstream(source)
            if path is not None:  # else the preset's own value stays (e.g. a random init)
                wiring[key] = str(path)
        for key, name in DEMO_FILES.get(stage, {}).items():
            wiring[key] = [str(self.demo / f"{name}.jsonl")]
        # JSON values are valid YAML, so paths with odd characters survive load_config's parsing
        overrides = [*section.overrides, *(f"{key}={json.dumps(value)}" for key, value in wiring.items())]
        config = load_config(schema, section.config, overrides)
        if config.trainer.strategy != "single":
            # each rank would re-run the whole pipeline and race on its records; run such stages on their own
            raise ConfigError(
                f"{stage}: the pipeline runs single-process stages; got trainer.strategy={config.trainer.strategy}"
            )
        for key, source in upstream.items():
            if key not in wiring and (value := functools.reduce(getattr, key.split("."), config)):
                log.info("%s: %s=%s from the preset (no %s output in this pipeline)", stage, key, value, source)
                inputs[source] = _folder_fingerprint(Path(value))  # its contents are an input all the same
        if stage != "prepare":
            inputs["data"] = self.upstream("prepare")[1] if stage == "pretrain" else self.demo_hash
        self.configs[stage] = config
        return config, inputs

    def upstream(self, stage: str) -> tuple[Path | None, str]:
        """Where a stage's input comes from: this run's output, else start_checkpoint (a language model),
        else what an earlier pipeline run left, else nothing."""
        if stage in self.outputs:
            return self.outputs[stage]
        if self.config.start_checkpoint and stage in ("pretrain", "sft"):
            path = Path(self.config.start_checkpoint)
            return path, _folder_fingerprint(path)
        if stage == "prepare":
            manifest = _read_json(self.corpus / "manifest.json")
            return self.corpus, _data_hash(manifest) if manifest else "none"
        record = _read_json(self.stage_dir(stage) / RECORD)
        final = self.stage_dir(stage) / "final"
        return (final, record["hash"]) if record and final.is_dir() else (None, "none")

    def run(self) -> None:
        from data.demo_tasks import write_demo_dataset

        demo = self.config.demo
        # The demo data is cheap and idempotent, and every stage after pretraining reads it: always made.
        write_demo_dataset(self.demo, n_train=demo.n_train, n_val=demo.n_val, n_pairs=demo.n_pairs, seed=demo.seed)
        self.demo_hash = _sha((self.demo / "demo_manifest.json").read_text())
        for index, stage in enumerate(self.config.stages, start=1):
            print(
                f"\n=== pipeline {self.config.name}: stage {index}/{len(self.config.stages)}: {stage} ===", flush=True
            )
            start = time.perf_counter()
            self.prepare() if stage == "prepare" else self.model_stage(stage)
            log.info("%s: %s in %.0fs", stage, self.status[stage], time.perf_counter() - start)

    def prepare(self) -> None:
        from data.prepare import prepare

        # prepare() is idempotent with exact change detection (input sha256, tokenizer fingerprint, settings):
        # calling it costs seconds, and the manifest it leaves is the data's identity for the stages after.
        digest = _data_hash(prepare(self.load_stage_config("prepare")[0].data))
        record = _read_json(self.stage_dir("prepare") / RECORD)
        self.status["prepare"] = "skipped: up to date" if record and record["hash"] == digest else "ran"
        if self.status["prepare"] == "ran":
            _write_record(self.stage_dir("prepare"), {"stage": "prepare", "hash": digest})
        self.outputs["prepare"] = (self.corpus, digest)

    def model_stage(self, stage: str) -> None:
        config, inputs = self.load_stage_config(stage)
        digest = _sha(to_yaml(config), json.dumps(inputs, sort_keys=True))  # before resume is set: not part of it
        run_dir, final = self.stage_dir(stage), self.stage_dir(stage) / "final"
        record, pending = _read_json(run_dir / RECORD), _read_json(run_dir / PENDING)
        if record and record["hash"] == digest and final.is_dir():
            self.status[stage] = "skipped: up to date"
        else:
            start = time.perf_counter()
            resume = record is None and bool(pending) and pending["hash"] == digest  # interrupted, same config
            self.train(stage, config, digest, resume)
            if resume and not final.is_dir():
                # the stage's export is the only way a model leaves a run; never record a stage without one
                log.warning("%s: the resumed run exported no final model; training it again from scratch", stage)
                self.train(stage, config, digest, resume=False)
            if not final.is_dir():
                raise RuntimeError(f"{stage} ended without writing {final}")
            _write_record(
                run_dir,
                {"stage": stage, "hash": digest, "inputs": inputs, "seconds": round(time.perf_counter() - start, 1)},
            )
            (run_dir / PENDING).unlink(missing_ok=True)
        self.outputs[stage] = (final, digest)

    def train(self, stage: str, config: Any, digest: str, resume: bool) -> None:
        run_dir = self.stage_dir(stage)
        if resume:
            config.checkpoint.resume, self.status[stage] = "auto", "resumed"  # the stage's own resume
        else:
            # new or changed: never resume another config's checkpoints; keep one backup, not a pile of them
            if run_dir.exists():
                backup = run_dir.with_name(f"{stage}.previous")
                shutil.rmtree(backup, ignore_errors=True)
                run_dir.rename(backup)
                log.info("%s: config or inputs changed; moved the old run to %s", stage, backup)
            config.checkpoint.resume, self.status[stage] = "none", "ran"
        _write_record(run_dir, {"stage": stage, "hash": digest}, name=PENDING)  # "started with this hash"
        module, function = RUNNERS[stage]
        getattr(importlib.import_module(module), function)(config)


def _write_record(folder: Path, record: dict[str, Any], name: str = RECORD) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".tmp-{name}"
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    temporary.replace(folder / name)  # atomic: a crash leaves the old record or the new one


# stage -> (module, function): imported only when the stage runs, so loading a config stays light
RUNNERS = {
    "pretrain": ("trainer.pretrain", "run_pretrain"),
    "sft": ("alignment.sft", "run_sft"),
    "rm": ("alignment.reward", "run_rm"),
    "ppo": ("alignment.ppo", "run_ppo"),
}


# ---- the report ----

Series = dict[str, list[tuple[int, float]]]
TABLE_MODELS = {"base": "pretrain", "sft": "sft", "ppo": "ppo"}  # column -> the stage whose final/ answers


def stage_metrics(stage: str, run_dir: Path) -> Series:
    """Every metric,step,value CSV the stage's plots left (metrics.csv, accuracy.csv, kl.csv, ...), plus PPO's
    evaluation history, which only its checkpoints keep."""
    from trainer.plots import read_metrics_csv

    series: Series = {}
    for path in sorted(run_dir.glob("*.csv")):  # a stage killed mid-run may have left a torn last row: dropped
        for name, points in read_metrics_csv(path).items():
            series.setdefault(name, []).extend(points)
    if stage == "ppo":
        import torch

        from trainer.callbacks import latest_checkpoint

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
    import matplotlib

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
    from tqdm.auto import tqdm

    from alignment.evaluation import answer_prompts
    from data.demo_tasks import load_jsonl, score_example
    from data.tokenizer import Tokenizer
    from models import load_checkpoint

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
    key = _sha(
        json.dumps(
            [
                spec,
                pipeline.demo_hash,
                str(pipeline.config.report),
                [(c, pipeline.upstream(TABLE_MODELS[c])[1]) for c in models],
            ]
        )
    )
    if (cache := _read_json(cache_path)) and cache.get("key") == key:
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
        manifest = _read_json(pipeline.corpus / "manifest.json") or {"splits": {}}
        tokens = ", ".join(f"{name} {split['tokens']:,} tokens" for name, split in manifest["splits"].items())
        demo = pipeline.config.demo
        lines.append(
            f"- **prepare** ({pipeline.status['prepare']}): corpus {tokens}; demo tasks {demo.n_train} train, {demo.n_val} val, {demo.n_pairs} pairs"
        )
    for stage in (s for s in pipeline.config.stages if s != "prepare"):
        run_dir = pipeline.stage_dir(stage)
        metrics[stage] = stage_metrics(stage, run_dir)
        seconds = (_read_json(run_dir / RECORD) or {}).get("seconds")
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


def run_pipeline(config_path: str | None, overrides: list[str]) -> Path:
    """Run the configured stages (skipping the up-to-date ones), write OUT_DIR/report.md, print where
    everything is and return OUT_DIR."""
    # STAGE.KEY=VALUE (e.g. sft.trainer.max_steps=50) is appended to that stage's overrides: one stage
    # setting changes from the command line without restating the preset's list
    staged: dict[str, list[str]] = {}
    plain = []
    for item in overrides:
        stage, _, rest = item.partition("=")[0].strip().partition(".")
        if stage in MODEL_STAGES and rest and rest.split(".")[0] not in ("config", "overrides"):
            staged.setdefault(stage, []).append(item.strip()[len(stage) + 1 :])
        else:
            plain.append(item)
    config = load_config(PipelineConfig, config_path, plain)
    for stage, items in staged.items():
        getattr(config, stage).overrides.extend(items)
    pipeline = Pipeline(config)
    pipeline.run()
    report = write_report(pipeline)
    lines = [f"\npipeline {pipeline.config.name} finished: {pipeline.root}", f"report:      {report}"]
    for stage in pipeline.config.stages:
        if stage != "prepare":
            lines.append(f"{stage + ':':<12} {pipeline.stage_dir(stage) / 'final'}  ({pipeline.status[stage]})")
    wandb_runs = [
        run for stage in pipeline.config.stages for run in sorted(pipeline.stage_dir(stage).glob("wandb/*run-*"))
    ]
    lines += [f"W&B run:     {run}" for run in wandb_runs]
    offline = [str(run) for run in wandb_runs if run.name.startswith("offline-")]
    if offline:
        lines.append(f"upload the offline W&B runs with: wandb sync {' '.join(offline)}")
    print("\n".join(lines), flush=True)
    return pipeline.root
