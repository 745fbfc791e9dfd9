"""trainer/loggers.py: the CSV logger that keeps a resumed run's history, W&B started without noise, and a job
tracked as W&B users expect: one run across its resumes (steps never repeated), its group, job type, summary and
model artifacts, system charts where they pay, and a finished run reopened by its id.

W&B runs offline here (there is no network): what a run holds is read back from its offline folders
(``wandb/offline-run-*/run-ID.wandb``, W&B's transaction log, the very file ``wandb sync`` uploads).
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import trainer.build
from alignment.schemas.pretrain import PretrainConfig
from alignment.stages.pretrain import run_pretrain
from models.errors import ConfigError
from tests.alignment.test_pretrain_run import RUN_NAME, TINY, isolate_wandb, tiny_config, wandb_records
from trainer.config import LoggerConfig, load_config
from trainer.loggers import (
    HistoryCSVLogger,
    _wandb_settings,
    close_logger,
    make_logger,
    recorded_run,
)
from trainer.plots import read_csv_rows
from trainer.storage import claim_run_directory
from trainer.wandb_run import read_run_record

wandb = pytest.importorskip("wandb")


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def offline_runs(folder: Path) -> list[dict]:
    """Every offline W&B run under ``folder/wandb``, in the order they started, each read once W&B's service has
    written its exit record: {"id", "group", "job_type", "resume", "history": [rows], "summary": {key: value},
    "artifacts": [{"name", "type", "aliases", "files", "metadata"}]}."""
    runs = []
    for log in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        deadline = time.monotonic() + 60  # finish() has returned; the service writes the last blocks a moment later
        while True:
            try:
                records = list(wandb_records(log))
                if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
                    break
            except AssertionError:  # a chunk still being written
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)
        run = {"history": [], "summary": {}, "artifacts": [], "exit": False}
        for record in records:
            kind = record.WhichOneof("record_type")
            if kind == "run" and "id" not in run:
                start = record.run.start_time
                run.update(id=record.run.run_id, group=record.run.run_group, job_type=record.run.job_type)
                run.update(resume=record.run.resume, start=(start.seconds, start.nanos))
            elif kind == "history":
                run["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item})
            elif kind == "summary":
                run["summary"].update({_key(i): json.loads(i.value_json) for i in record.summary.update})
            elif kind == "artifact":
                artifact = record.artifact
                files = sorted(entry.path for entry in artifact.manifest.contents)
                run["artifacts"].append(
                    {"name": artifact.name, "type": artifact.type, "aliases": set(artifact.aliases), "files": files,
                     "metadata": json.loads(artifact.metadata or "{}")}
                )  # fmt: skip
            elif kind == "exit":
                run["exit"] = True
        assert run["exit"], f"{log}: the W&B run was never finished (no exit record)"
        runs.append(run)
    return sorted(runs, key=lambda run: run["start"])


def write_rows(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "train/loss"])
        writer.writeheader()
        writer.writerows(rows)


def test_csv_logger_keeps_the_history_before_a_resume_and_counts_replayed_steps_once(tmp_path):
    metrics = tmp_path / "csv" / "metrics.csv"
    write_rows(metrics, [{"step": step, "train/loss": 10 - step} for step in range(10)])
    with open(metrics, "a") as handle:
        handle.write("10,0.")  # a row torn by kill -9: dropped
    logger = HistoryCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    # resumed from the checkpoint at step 6: steps 6.. are replayed and logged again
    logger.log_metrics({"train/loss": 3.5, "val/loss": 4.0}, step=6)
    logger.log_metrics({"train/loss": 2.5}, step=7)
    logger.save()
    rows = read_csv_rows(metrics)
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [float(row["train/loss"]) for row in rows] == [10, 9, 8, 7, 6, 5, 3.5, 2.5]
    assert rows[6]["val/loss"] == "4.0" and rows[0]["val/loss"] == ""
    logger.log_metrics({"train/loss": 1.5}, step=8)
    logger.save()
    assert [int(row["step"]) for row in read_csv_rows(metrics)] == list(range(9))


def test_csv_logger_in_a_fresh_folder_writes_only_new_rows(tmp_path):
    logger = HistoryCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    logger.log_metrics({"train/loss": 1.0}, step=0)
    logger.save()
    assert read_csv_rows(tmp_path / "csv" / "metrics.csv") == [{"step": "0", "train/loss": "1.0"}]


def test_a_stage_that_fails_after_wandb_started_leaves_no_run_open(data_dir, tmp_path, monkeypatch):
    """W&B starts when the logger is made; a stage that then fails before Lightning runs (here: building the
    Trainer) must still end that run, or the next stage in this process would reuse it."""
    isolate_wandb(monkeypatch, tmp_path)

    def no_trainer(*args, **kwargs):
        raise ConfigError("trainer: refused for this test")

    monkeypatch.setattr(trainer.build, "make_trainer", no_trainer)
    config = tiny_config(data_dir, tmp_path / "runs", "logger.kind=wandb")
    with pytest.raises(ConfigError, match="refused for this test"):
        run_pretrain(config)
    assert list((tmp_path / "runs" / RUN_NAME / "wandb").glob("offline-run-*")), "W&B never started: no test"
    assert wandb.run is None


def test_wandb_starts_offline_without_a_warning_the_user_did_not_cause(tmp_path, monkeypatch, capfd):
    """Lightning hands wandb.init anonymous=None, which wandb warns about ("The anonymous setting has no effect")
    on every stage of a default run; nothing the user set causes it, so nothing is printed."""
    isolate_wandb(monkeypatch, tmp_path)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    logger = make_logger(LoggerConfig(kind="wandb", mode="offline"), tmp_path, "quiet", {"seed": 1})
    try:
        assert logger.experiment is not None and list((tmp_path / "wandb").glob("offline-run-*"))
    finally:
        close_logger(logger)
    captured = capfd.readouterr()
    assert "anonymous" not in captured.err + captured.out
    assert "WARNING" not in captured.err + captured.out


# --------------------------------------------------------------------------------------------------
# one job, one W&B run


def test_a_job_stopped_and_resumed_is_one_wandb_run_whose_steps_go_on(data_dir, tmp_path, monkeypatch):
    """The most common Lightning + W&B complaint: a resumed job started a second run with half the curve. Here a
    job stops after logging step 3 with its last checkpoint at step 2 (a kill between checkpoints), then resumes
    and replays step 3: both offline folders hold the same run id (as read from W&B's own logs), the resumed one
    asks W&B to resume it (``wandb sync`` then uploads it into that run, after the first), and the steps go on
    without going back or repeating the replayed one. With ``logger.log_model=all`` each checkpoint, and final/
    at the end, is a model artifact with its step, aliases and the config; the summary holds the final figures."""
    isolate_wandb(monkeypatch, tmp_path)
    common = ("logger.kind=wandb", "logger.mode=offline", "trainer.val_every_n_steps=2", "checkpoint.every_n_steps=2")
    run_dir = run_pretrain(tiny_config(data_dir, tmp_path / "runs", *common, "trainer.max_steps=3"))
    for path in (run_dir / "checkpoints").glob("step-00000003.ckpt*"):  # the kill: step 3's checkpoint never written
        path.unlink()
    run_pretrain(tiny_config(data_dir, tmp_path / "runs", *common, "trainer.max_steps=5", "logger.log_model=all"))

    first, resumed = offline_runs(run_dir)
    assert first["id"] == resumed["id"] == read_run_record(run_dir)["id"]
    assert first["resume"] and resumed["resume"], "the run does not ask W&B to resume it by its id"
    assert first["job_type"] == resumed["job_type"] == "pretrain"
    # Lightning's logging step (trainer/global_step, W&B's x axis) is the optimizer step before it: 0..4 for 1..5
    train = [row["trainer/global_step"] for run in (first, resumed) for row in run["history"] if "train/loss" in row]
    assert train == [0, 1, 2, 3, 4], f"steps went back or repeated across the resume: {train}"
    assert [row["trainer/global_step"] for row in resumed["history"] if "train/loss" in row] == [3, 4]
    val = [row["trainer/global_step"] for run in (first, resumed) for row in run["history"] if "val/loss" in row]
    assert val == [1, 3]

    assert resumed["summary"]["final/step"] == 5
    assert resumed["summary"]["final/val/loss"] == [r["val/loss"] for r in resumed["history"] if "val/loss" in r][-1]
    artifacts = {(a["name"], frozenset(a["aliases"])): a for a in resumed["artifacts"]}
    run_id = resumed["id"]
    assert set(artifacts) == {
        (f"checkpoint-{run_id}", frozenset({"latest", "step-4"})),
        (f"checkpoint-{run_id}", frozenset({"latest", "step-5"})),
        (f"model-{run_id}", frozenset({"latest", "final", "step-5"})),
    }
    checkpoint = artifacts[(f"checkpoint-{run_id}", frozenset({"latest", "step-4"}))]
    assert checkpoint["type"] == "model" and checkpoint["metadata"]["step"] == 4
    assert checkpoint["files"] == ["step-00000004.ckpt", "step-00000004.ckpt.sha256"]
    assert checkpoint["metadata"]["config"]["trainer"]["max_steps"] == 5
    model = artifacts[(f"model-{run_id}", frozenset({"latest", "final", "step-5"}))]
    assert {"final/lantern.json", "final/tokenizer.model"} <= set(model["files"]), model["files"]
    assert not first["artifacts"], "log_model is off by default"


def test_a_finished_run_reopened_by_its_id_takes_summary_keys_into_the_same_run(tmp_path, monkeypatch):
    """The pipeline's report writes its figures into each stage's run after the run ended: reopened by the id in
    its run folder, it is a new offline folder of the same run, in its group and with its job type (the stage the
    folder was claimed for); the stage's own final figures were written into the summary when it ended well."""
    isolate_wandb(monkeypatch, tmp_path)
    run_dir = tmp_path / "sft"
    claim_run_directory(run_dir, "sft")
    logger = make_logger(LoggerConfig(kind="wandb", mode="offline", group="tiny-1a2b3c4d"), run_dir, "sft", {})
    logger.log_metrics({"train/loss": 2.0, "val/loss": 1.5, "val/accuracy": 0.25}, step=3)
    logger.finalize("success")
    with recorded_run(run_dir, LoggerConfig(mode="offline")) as run:
        run.summary.update({"report/heldout_accuracy": 0.5, "report/heldout_se": 0.1})

    stage, reopened = offline_runs(run_dir)
    assert stage["id"] == reopened["id"]
    assert {(run["group"], run["job_type"]) for run in (stage, reopened)} == {("tiny-1a2b3c4d", "sft")}
    assert stage["summary"]["final/val/accuracy"] == 0.25 and stage["summary"]["final/step"] == 3
    assert "final/train/loss" not in stage["summary"]  # the final figures are the validation's
    assert reopened["summary"]["report/heldout_accuracy"] == 0.5 and not reopened["history"]


def test_a_failed_artifact_upload_is_a_warning_and_the_run_logs_on(tmp_path, monkeypatch):
    """``logger.log_model=all`` and W&B refusing the artifact (a full disk, a dropped connection): one warning naming
    the checkpoint, which stays on disk, and the metrics go on being logged."""
    import wandb.sdk.wandb_run

    isolate_wandb(monkeypatch, tmp_path)

    def refused(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log_artifact", refused)
    checkpoint = tmp_path / "checkpoints" / "step-00000002.ckpt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"weights")
    logger = make_logger(LoggerConfig(kind="wandb", mode="offline", log_model="all"), tmp_path, "run", {})
    try:
        with pytest.warns(UserWarning, match="could not log .*step-00000002.ckpt.*training goes on"):
            logger.after_save_checkpoint(SimpleNamespace(last_saved=checkpoint))
        logger.log_metrics({"train/loss": 1.0}, step=2)
    finally:
        close_logger(logger)
    assert [row["train/loss"] for row in offline_runs(tmp_path)[0]["history"]] == [1.0]


def test_log_model_is_off_final_or_all_named_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="logger.log_model") as raised:
        load_config(PretrainConfig, TINY, ["logger.log_model=every"])
    assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"logger.log_model must be one of off, final, all .*'every'"):
        make_logger(LoggerConfig(kind="wandb", mode="offline", log_model="every"), tmp_path, "run", {})
    assert not (tmp_path / "wandb").exists(), "W&B started before the config was checked"
    assert load_config(PretrainConfig, TINY, ["logger.log_model=off"]).logger.log_model is False  # YAML's off


def test_system_charts_are_on_unless_switched_off(tmp_path):
    """``logger.system_stats``: W&B's system charts (GPU utilisation, memory, power; CPU, RAM, disk) are on by
    default (docs/configuration.md has what they cost a CPU smoke run: nothing measurable); false switches them off."""
    assert LoggerConfig().system_stats is True
    assert _wandb_settings("offline", stats=True).x_disable_stats is False
    assert _wandb_settings("offline", stats=False).x_disable_stats is True
    for on in (True, False):  # what make_logger hands W&B
        (run_dir := tmp_path / str(on)).mkdir()
        logger = make_logger(LoggerConfig(mode="offline", system_stats=on), run_dir, "run", {})
        try:
            assert logger._wandb_init["settings"].x_disable_stats is not on
        finally:
            close_logger(logger)
