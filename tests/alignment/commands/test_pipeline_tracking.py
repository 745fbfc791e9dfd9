"""alignment/commands/pipeline_tracking.py: a pipeline run in W&B is one group (``NAME-ID``, kept across its resumes
and incremental re-runs, new when its first model stage trains from scratch), the report's figures land in each
stage's run summary, and the report itself is one artifact of a pipeline-level run in that group.

No stage trains here: the stage runners are stubbed, and the W&B runs are made with the logger alone (offline).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from alignment.commands.pipeline import Pipeline, load_pipeline_config
from alignment.commands.pipeline_tracking import TRACKING, stage_summary, track_report, wandb_run_lines
from alignment.stages import registry
from tests.alignment.test_pretrain_run import isolate_wandb
from tests.trainer.test_loggers import offline_runs
from trainer.config import LoggerConfig
from trainer.loggers import make_logger
from trainer.storage import claim_run_directory

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs" / "pipeline" / "tiny.yaml")
GROUP = re.compile(r"tiny-[a-z0-9]{8}")

SFT_ENTRY = {
    "heldout": {
        "accuracy": 0.5,
        "se": 0.125,
        "n": 16,
        "per_task": {"line_count": {"accuracy": 0.25, "se": 0.2, "n": 8}},
    },
    "sampled": {"accuracy": 0.375, "se": 0.1, "n": 4, "per_task": {}, "samples": 2, "temperature": 1.0},
    "pass_at_k": {"k": 2, "pass_at_k": 0.75, "se": 0.2, "n": 4, "per_task": {}},
    "kl": None,
    "seconds": 12.5,
}
PPO_ENTRY = {
    "heldout": {"accuracy": 0.625, "se": 0.12, "n": 16, "per_task": {}},
    "kl": 0.031,
    "seconds": 30.0,
    "vs_sft": {"difference": 0.125, "se": 0.05, "n": 16, "verdict": "gain"},
}


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)


def stub_runner(monkeypatch, stage: str, run) -> None:
    """The stage's record with ``run`` as its run function, for the rest of the test."""
    record = dataclasses.replace(registry.stage_named(stage), run_at=run)
    monkeypatch.setattr(registry, "STAGES", registry.with_stage(record))


def fake_runner(trained: list, *, stop: bool = False):
    """A stage runner that trains nothing: it notes the W&B group it was given and leaves a final/ (or stops)."""

    def run(config, stage):
        section = stage.training_section(config)
        trained.append(section.logger.group)
        if stop:
            raise KeyboardInterrupt
        (Path(config.run.out_dir) / config.run.name / "final").mkdir(parents=True)

    return run


def test_a_pipeline_run_is_one_group_kept_across_resumes_and_new_when_it_starts_afresh(tmp_path, in_repo, monkeypatch):
    """Two pipelines (two folders) never share a group; an interrupted stage resumes in its group, a re-run that
    re-trains a later stage stays in it, and a re-run whose first model stage trains from scratch (a new seed) is a
    new pipeline run with a new group. Every stage's logger gets the group; its job type is its stage."""
    trained: list[str] = []
    overrides = [f"out_dir={tmp_path / 'a'}", "logger.kind=wandb", "logger.mode=offline"]
    first = Pipeline(load_pipeline_config(TINY, overrides))
    first.write_demo()
    group = first.load_stage_config("pretrain")[0].logger.group
    assert GROUP.fullmatch(group)
    assert first.load_stage_config("rejection_sampling")[0].sft.logger.group == group  # its SFT section logs
    other = Pipeline(load_pipeline_config(TINY, [f"out_dir={tmp_path / 'b'}"]))
    assert other.load_stage_config("pretrain")[0].logger.group != group

    stub_runner(monkeypatch, "pretrain", fake_runner(trained, stop=True))
    with pytest.raises(KeyboardInterrupt):
        first.model_stage("pretrain")  # interrupted: its pending record stays, with the group it trained in
    stub_runner(monkeypatch, "pretrain", fake_runner(trained))
    resumed = Pipeline(load_pipeline_config(TINY, overrides))
    resumed.model_stage("pretrain")
    assert resumed.status["pretrain"] == "resumed" and trained == [group, group]

    stub_runner(monkeypatch, "sft", fake_runner(trained))
    rerun = Pipeline(load_pipeline_config(TINY, overrides))
    rerun.write_demo()  # the stages after pretraining read the demo data
    rerun.model_stage("pretrain")
    rerun.model_stage("sft")
    assert rerun.status["pretrain"] == "skipped: up to date" and trained == [group, group, group]

    reseeded = Pipeline(load_pipeline_config(TINY, [*overrides, "seed=7"]))
    reseeded.model_stage("pretrain")
    assert reseeded.status["pretrain"] == "ran" and GROUP.fullmatch(trained[-1]) and trained[-1] != group
    assert json.loads((tmp_path / "a" / TRACKING).read_text())["group"] == trained[-1]


def test_the_report_figures_are_flat_summary_keys():
    assert stage_summary(SFT_ENTRY) == {
        "report/seconds": 12.5,
        "report/heldout_accuracy": 0.5, "report/heldout_se": 0.125, "report/heldout_n": 16,
        "report/heldout_accuracy/line_count": 0.25,
        "report/sampled_accuracy": 0.375, "report/sampled_se": 0.1, "report/sampled_n": 4,
        "report/pass_at_k": 0.75, "report/pass_at_k_se": 0.2, "report/k": 2,
    }  # fmt: skip
    ppo = stage_summary(PPO_ENTRY)
    assert ppo["report/kl_to_sft"] == 0.031
    assert (ppo["report/vs_sft"], ppo["report/vs_sft_se"], ppo["report/vs_sft_verdict"]) == (0.125, 0.05, "gain")
    assert stage_summary({"heldout": None, "kl": None, "seconds": None}) == {}


def test_the_report_goes_into_each_stage_run_and_up_as_one_artifact_in_the_group(tmp_path, monkeypatch):
    """After the report: each stage's W&B run (reopened by its id) holds the report's figures for it, and a run
    of job type ``report`` in the pipeline's group holds them all and the artifact ``report-GROUP`` (report.json,
    report.md, the plots). A re-run whose report did not change writes nothing to W&B."""
    isolate_wandb(monkeypatch, tmp_path)
    overrides = [f"out_dir={tmp_path / 'pipeline'}", "logger.kind=wandb", "logger.mode=offline"]
    pipeline = Pipeline(load_pipeline_config(TINY, [*overrides, "stages=[prepare,pretrain,sft,ppo]"]))
    group, root = pipeline.tracking.group, pipeline.root
    for stage in ("sft", "ppo"):
        claim_run_directory(root / stage, stage)
        logger = make_logger(LoggerConfig(kind="wandb", mode="offline", group=group), root / stage, stage, {})
        logger.log_metrics({"val/loss": 1.0}, step=1)
        logger.finalize("success")
    report = {"stages": {"pretrain": {"heldout": None, "kl": None, "seconds": 3.0}, "sft": SFT_ENTRY, "ppo": PPO_ENTRY}}
    (root / "report.json").write_text(json.dumps(report))
    (root / "report.md").write_text("# Lantern pipeline `tiny`\n")
    (root / "report").mkdir()
    (root / "report" / "overview.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))

    track_report(pipeline)
    for stage, entry in (("sft", SFT_ENTRY), ("ppo", PPO_ENTRY)):
        trained, reopened = offline_runs(root / stage)
        assert trained["id"] == reopened["id"] and (reopened["group"], reopened["job_type"]) == (group, stage)
        assert {k: reopened["summary"][k] for k in stage_summary(entry)} == stage_summary(entry)
    (report_run,) = offline_runs(root)
    assert (report_run["group"], report_run["job_type"]) == (group, "report")
    assert report_run["summary"]["ppo/vs_sft_verdict"] == "gain" and report_run["summary"]["sft/heldout_n"] == 16
    (artifact,) = report_run["artifacts"]
    assert (artifact["name"], artifact["type"]) == (f"report-{group}", "report")
    assert artifact["files"] == ["report.json", "report.md", "report/overview.png"]
    lines = "\n".join(wandb_run_lines(pipeline))
    assert f"W&B group:   {group}" in lines and "wandb sync" in lines and str(root / "wandb") in lines

    folders = sorted(root.rglob("offline-run-*"))
    track_report(Pipeline(load_pipeline_config(TINY, [*overrides, "stages=[prepare,pretrain,sft,ppo]"])))
    assert sorted(root.rglob("offline-run-*")) == folders, "an unchanged report was written to W&B again"
