"""trainer/loggers.py: the CSV logger that keeps a resumed run's history, and W&B started without noise."""

from __future__ import annotations

import csv

import pytest

from alignment.stages.pretrain import run_pretrain
from models.errors import ConfigError
from tests.alignment.test_pretrain_run import RUN_NAME, isolate_wandb, tiny_config
from trainer.config import LoggerConfig
from trainer.loggers import HistoryCSVLogger, close_logger, make_logger
from trainer.plots import read_csv_rows

wandb = pytest.importorskip("wandb")


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
    """W&B starts when the logger is made; a stage that then fails before Lightning runs (here: a resume path
    that does not exist) must still end that run, or the next stage in this process would reuse it."""
    isolate_wandb(monkeypatch, tmp_path)
    config = tiny_config(data_dir, tmp_path / "runs", "logger.kind=wandb", "checkpoint.resume=/no/such/checkpoint")
    with pytest.raises(ConfigError, match="checkpoint.resume"):
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
