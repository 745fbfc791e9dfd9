"""trainer/wandb_run.py: the W&B run's record in the run folder (its id kept only when training resumes from this
folder's checkpoint), the filter that keeps a resumed run from logging a step twice, and ``logger.log_model``."""

from __future__ import annotations

import json

import pytest

from models.errors import ConfigError
from trainer.loggers import resumes_run
from trainer.wandb_run import RUN_RECORD, LoggedSteps, check_log_model, read_run_record, start_run_record


def test_the_run_id_is_kept_only_when_training_resumes_from_this_folders_checkpoint(tmp_path):
    """Resuming from a checkpoint of this folder continues its W&B run; anything that trains from step 0 (a new
    folder, checkpoint.resume=none, a checkpoint of another folder) is a new run with a new id."""
    first = start_run_record(tmp_path, resuming=False, project="lantern", group="tiny-1a2b3c4d", job_type="sft")
    assert len(first["id"]) == 8 and first["step"] == -1
    assert read_run_record(tmp_path) == first
    assert start_run_record(tmp_path, resuming=True, project="lantern")["id"] == first["id"]
    assert start_run_record(tmp_path, resuming=False, project="lantern")["id"] != first["id"]
    (tmp_path / "new").mkdir()
    assert start_run_record(tmp_path / "new", resuming=True)["id"] != first["id"]

    own = tmp_path / "checkpoints" / "step-00000002.ckpt"
    assert resumes_run(tmp_path, str(own))
    assert not resumes_run(tmp_path, None)
    assert not resumes_run(tmp_path, str(tmp_path / "other-run" / "checkpoints" / "step-00000002.ckpt"))


def test_a_record_that_does_not_read_is_no_run(tmp_path):
    (tmp_path / RUN_RECORD).write_text("{torn")
    assert read_run_record(tmp_path) is None
    (tmp_path / RUN_RECORD).write_text(json.dumps({"id": ""}))
    assert read_run_record(tmp_path) is None
    assert start_run_record(tmp_path, resuming=True)["id"]  # resuming such a folder starts a new run


def test_steps_an_earlier_start_logged_are_not_logged_again(tmp_path):
    """Killed after logging step 5's training row (not its validation), resumed from the checkpoint at step 3:
    the replayed steps 4 and 5 are dropped, except step 5's validation row, which was never logged."""
    record = start_run_record(tmp_path, resuming=False)
    steps = LoggedSteps(tmp_path, record)
    for step in range(6):
        steps.logged({"train/loss": 1.0, "lr": 0.1}, step)
    assert read_run_record(tmp_path)["step"] == 5  # kept in the run folder as it goes

    resumed = LoggedSteps(tmp_path, read_run_record(tmp_path))
    assert resumed.new({"train/loss": 0.9, "lr": 0.1}, 4) == {}
    assert resumed.new({"train/loss": 0.8, "lr": 0.1}, 5) == {}
    assert resumed.new({"val/loss": 0.7}, 5) == {"val/loss": 0.7}
    assert resumed.new({"train/loss": 0.6}, 6) == {"train/loss": 0.6}


def test_log_model_reads_yaml_booleans_and_refuses_anything_else():
    assert [check_log_model(value) for value in (False, True, "off", "final", "all")] == [
        "off", "final", "off", "final", "all"
    ]  # fmt: skip
    for value in ("every", 1, None):
        with pytest.raises(ConfigError, match="logger.log_model must be one of off, final, all"):
            check_log_model(value)
