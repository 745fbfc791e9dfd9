"""The pipeline in Weights & Biases: one group per pipeline run (``NAME-ID``, kept in ``pipeline_wandb.json``), the
report's figures in each stage's run summary, and the report as a versioned artifact of a pipeline-level run.

A pipeline run begins when its first model stage trains from scratch; resuming it, or re-running later stages, keeps
the group. The figures exist only after every model is evaluated, so each stage's finished run is reopened by its id,
and only when its figures changed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alignment.commands.pipeline_records import read_json, write_record
from models.files.digests import content_key
from trainer.loggers import recorded_run
from trainer.wandb_run import new_run_id, read_run_record

if TYPE_CHECKING:  # for annotations only: alignment.commands.pipeline imports this module
    from alignment.commands.pipeline import Pipeline

log = logging.getLogger("lantern.pipeline")
TRACKING = "pipeline_wandb.json"


class PipelineTracking:
    """The pipeline folder's W&B group: the recorded one, else a new ``NAME-ID`` (recorded once a stage trains)."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name
        self.record = read_json(root / TRACKING) or {}
        self.fresh = not isinstance(self.record.get("group"), str)  # made by this process, not recorded yet
        self.group: str = self.record["group"] if not self.fresh else f"{name}-{new_run_id()}"

    def renew(self) -> bool:
        """A new pipeline run (its first model stage trains from scratch): a new group, unless this process made
        the current one. Returns whether the group changed (the stage's wiring, and so its hash, did too)."""
        if self.fresh:
            return False
        self.record, self.fresh, self.group = {}, True, f"{self.name}-{new_run_id()}"
        log.info("a new pipeline run: its W&B group is %s", self.group)
        return True

    def save(self, **changes: Any) -> None:
        self.record.update(group=self.group, **changes)
        write_record(self.root, self.record, name=TRACKING)


def stage_summary(entry: dict[str, Any]) -> dict[str, Any]:
    """A stage's entry of report.json as flat W&B summary keys: ``report/heldout_accuracy``, its ``_se`` and ``_n``,
    the sampled accuracy, pass@k, ``report/kl_to_sft``, the paired difference from SFT with its verdict, the
    training time and the greedy accuracy per task."""
    summary: dict[str, Any] = {"report/seconds": entry.get("seconds"), "report/kl_to_sft": entry.get("kl")}
    for key in ("heldout", "sampled"):
        if entry.get(key):
            summary.update({f"report/{key}_accuracy": entry[key]["accuracy"], f"report/{key}_se": entry[key]["se"]})
            summary[f"report/{key}_n"] = entry[key]["n"]
    if entry.get("heldout"):
        for task, numbers in (entry["heldout"].get("per_task") or {}).items():
            summary[f"report/heldout_accuracy/{task}"] = numbers["accuracy"]
    if entry.get("pass_at_k"):
        pass_k = entry["pass_at_k"]
        summary.update({"report/pass_at_k": pass_k["pass_at_k"], "report/pass_at_k_se": pass_k["se"]})
        summary["report/k"] = pass_k["k"]
    for key in ("vs_sft", "vs_sft_sampled"):
        if entry.get(key):
            summary.update({f"report/{key}": entry[key]["difference"], f"report/{key}_se": entry[key]["se"]})
            summary[f"report/{key}_verdict"] = entry[key]["verdict"]
    return {key: value for key, value in summary.items() if value is not None}


def track_report(pipeline: Pipeline) -> None:
    """After report.json is written: the figures into each stage's W&B run summary (where they changed), and the
    report (report.json, report.md, the plots) as one artifact of the pipeline's report run, in its group."""
    logger, tracking = pipeline.config.logger, pipeline.tracking
    report = read_json(pipeline.root / "report.json")
    if logger.kind != "wandb" or report is None:
        return
    written = dict(tracking.record.get("summaries") or {})
    summaries = {stage: stage_summary(entry) for stage, entry in report["stages"].items()}
    for stage, summary in summaries.items():
        run_dir = pipeline.stage_dir(stage)
        record = read_run_record(run_dir)  # none: the stage logged no W&B run (another logger, W&B failed)
        key = content_key(summary, record and record["id"])  # a re-trained stage is a new run: written again
        if record is None or not summary or written.get(stage) == key:
            continue
        with recorded_run(run_dir, logger) as run:
            if run is not None:
                run.summary.update(summary)
                written[stage] = key
    tracking.save(summaries=written)
    files = [
        pipeline.root / "report.json",
        pipeline.root / "report.md",
        *sorted((pipeline.root / "report").glob("*.png")),
    ]
    key = content_key(json.dumps(report, sort_keys=True), tracking.group)
    if tracking.record.get("report") == key:
        return
    identity = {
        "project": logger.project,
        "group": tracking.group,
        "job_type": "report",
        "name": f"{tracking.name}-report",
    }
    with recorded_run(pipeline.root, logger, **identity) as run:
        if run is None:
            return
        run.summary.update(
            {
                f"{stage}/{k.removeprefix('report/')}": v
                for stage, summary in summaries.items()
                for k, v in summary.items()
            }
        )
        try:
            import wandb  # deferred: only pipelines that log to W&B import it

            artifact = wandb.Artifact(
                f"report-{tracking.group}", type="report", metadata={"stages": list(report["stages"])}
            )
            for path in (p for p in files if p.is_file()):
                artifact.add_file(str(path), name=str(path.relative_to(pipeline.root)))
            run.log_artifact(artifact, aliases=["latest"])
        except Exception as error:  # the report is on disk either way
            log.warning("W&B could not log the report as an artifact (%s)", error)
            return
    tracking.save(report=key)


def wandb_run_lines(pipeline: Pipeline) -> list[str]:
    """The W&B run folders of the stages and of the report, and the command that uploads the offline ones."""
    folders = [pipeline.stage_dir(stage) for stage in pipeline.config.stages] + [pipeline.root]
    runs = [run for folder in folders for run in sorted(folder.glob("wandb/*run-*"))]
    lines = [f"W&B run:     {run}" for run in runs] + ([f"W&B group:   {pipeline.tracking.group}"] if runs else [])
    offline = [str(run) for run in runs if run.name.startswith("offline-")]
    if offline:  # several folders of one run (its resumes, the report's summaries) upload into that run, in order
        lines.append(f"upload the offline W&B runs with: wandb sync {' '.join(offline)}")
    return lines
