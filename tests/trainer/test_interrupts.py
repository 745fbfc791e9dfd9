"""The line an interrupted training command prints names the resume setting where its stage keeps it."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest

from alignment.stages import registry
from trainer.interrupts import interrupted_message

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["sft", "rejection_sampling"])
def test_the_resume_hint_names_the_stages_own_checkpoint_section(tmp_path, name):
    stage = registry.stage_named(name)
    prefix = stage.training_prefix
    preset = ROOT / stage.preset
    overrides = [f"run.out_dir={tmp_path}", "run.name=job", f"{prefix}checkpoint.resume=none"]
    checkpoints = tmp_path / "job" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step-3.ckpt").write_bytes(b"")  # named as a checkpoint; nothing is read at this moment
    args = argparse.Namespace(config=str(preset), overrides=overrides)
    line = interrupted_message(stage.command, signal.SIGTERM, KeyboardInterrupt(), args, stage.schema_location, prefix)
    assert line == (
        f"lantern {stage.command}: interrupted by SIGTERM; the last checkpoint is {checkpoints / 'step-3.ckpt'}: "
        f"run it again with {prefix}checkpoint.resume=auto to resume from it"
    )
