"""Checkpoints survive what kills runs: a stale or missing ``latest`` pointer, truncated and bit-flipped
checkpoint files (each checkpoint has a SHA-256 manifest; ``resume: auto`` takes the newest that verifies),
and kill -9, after which the metrics history (metrics.csv, the plot) is whole, each step counted once.

One tiny pretraining run of 6 steps (checkpoints at 2, 4, 6) is made per module and copied per test.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from alignment.stages.pretrain import run_pretrain
from tests.alignment.test_pretrain_run import RUN_NAME, read_metrics, tiny_config
from tests.helpers import subprocess_env
from trainer.checkpoints import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SIX_STEPS = (
    "trainer.max_steps=6",
    "trainer.val_every_n_steps=3",
    "checkpoint.every_n_steps=2",
    "checkpoint.keep_last=3",
)


@pytest.fixture(scope="module")
def six_step_run(data_dir, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("base")
    return run_pretrain(tiny_config(data_dir, runs, *SIX_STEPS))


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run in tmp_path/runs/RUN_NAME (final/ removed so that a resumed run trains again)."""
    copy = tmp_path / "runs" / RUN_NAME
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "final")
    return copy


class StartStep(L.Callback):
    """Records the optimizer step training starts from (0: from scratch; N: resumed from step N)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step


def resume_to(data_dir: Path, tmp_path: Path, steps: int) -> int:
    """Run the copied run on to ``steps`` with resume: auto; returns the step it started from."""
    start = StartStep()
    overrides = [*SIX_STEPS, f"trainer.max_steps={steps}"]
    run_pretrain(tiny_config(data_dir, tmp_path / "runs", *overrides), extra_callbacks=[start])
    return start.step


def test_every_checkpoint_has_a_sha256_manifest_and_pruning_removes_it(six_step_run):
    checkpoints = six_step_run / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == [
        "latest",
        "step-00000002.ckpt",
        "step-00000002.ckpt.sha256",
        "step-00000004.ckpt",
        "step-00000004.ckpt.sha256",
        "step-00000006.ckpt",
        "step-00000006.ckpt.sha256",
    ]
    for step in (2, 4, 6):
        checkpoint = checkpoints / f"step-{step:08d}.ckpt"
        manifest = json.loads((checkpoints / f"{checkpoint.name}.sha256").read_text())
        assert manifest["step"] == step
        assert manifest["sha256"] == {".": hashlib.sha256(checkpoint.read_bytes()).hexdigest()}


def test_pruning_removes_the_manifest_with_its_checkpoint(data_dir, tmp_path):
    run_dir = run_pretrain(
        tiny_config(
            data_dir,
            tmp_path / "runs",
            "trainer.max_steps=6",
            "trainer.val_every_n_steps=100",
            "checkpoint.every_n_steps=2",
            "checkpoint.keep_last=1",
        )
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step-00000006.ckpt",
        "step-00000006.ckpt.sha256",
    ]


def test_missing_latest_pointer_resumes_from_the_newest_checkpoint_not_step_0(six_step_run, data_dir, tmp_path):
    run_dir = copy_run(six_step_run, tmp_path)
    (run_dir / "checkpoints" / "latest").unlink()  # kill -9 between the first checkpoint's rename and its pointer
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step-00000006.ckpt"
    assert resume_to(data_dir, tmp_path, 8) == 6


def test_stale_latest_pointer_is_not_trusted(six_step_run, data_dir, tmp_path):
    run_dir = copy_run(six_step_run, tmp_path)
    (run_dir / "checkpoints" / "latest").write_text("step-00000002.ckpt\n")  # killed before the pointer moved on
    assert resume_to(data_dir, tmp_path, 8) == 6
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000008.ckpt"


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_one_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip_one_bit], ids=["truncated", "bit-flipped"])
def test_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_it(six_step_run, data_dir, tmp_path, damage):
    run_dir = copy_run(six_step_run, tmp_path)
    newest = run_dir / "checkpoints" / "step-00000006.ckpt"
    damage(newest)
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-00000006\.ckpt: checksum mismatch"):
        assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step-00000004.ckpt"
    with pytest.warns(UserWarning, match="step-00000006.ckpt"):
        assert resume_to(data_dir, tmp_path, 8) == 4
    # and the resumed run replaced the damaged checkpoint with a good one
    resumed = torch.load(newest, map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 6
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-00000008.ckpt"


def test_no_checkpoint_verifies_starts_from_scratch(six_step_run, data_dir, tmp_path):
    run_dir = copy_run(six_step_run, tmp_path)
    for checkpoint in (run_dir / "checkpoints").glob("step-*.ckpt"):
        truncate(checkpoint)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert latest_checkpoint(run_dir / "checkpoints") is None


def test_killed_mid_save_leaves_no_temporary_and_no_orphan_manifest(six_step_run, data_dir, tmp_path):
    """A kill between the manifest and the rename leaves `.tmp-step-N.ckpt` and a manifest without its
    checkpoint: the next run removes both and resumes from the newest complete checkpoint."""
    run_dir = copy_run(six_step_run, tmp_path)
    checkpoints = run_dir / "checkpoints"
    (checkpoints / ".tmp-step-00000008.ckpt").write_bytes(b"half a checkpoint")
    shutil.copy(checkpoints / "step-00000006.ckpt.sha256", checkpoints / "step-00000008.ckpt.sha256")
    assert latest_checkpoint(checkpoints).name == "step-00000006.ckpt"
    assert resume_to(data_dir, tmp_path, 7) == 6
    assert not list(checkpoints.glob(".tmp-*"))
    assert sorted(p.name for p in checkpoints.glob("*.sha256")) == [f"step-0000000{s}.ckpt.sha256" for s in (4, 6, 7)]


KILLER = """
import os, signal, sys
from pathlib import Path
import lightning as L
from tests.alignment.test_pretrain_run import tiny_config
from alignment.stages.pretrain import run_pretrain

class KillAt(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 5:
            os.kill(os.getpid(), signal.SIGKILL)

run_pretrain(tiny_config(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]), extra_callbacks=[KillAt()])
"""


def test_metrics_history_survives_kill_9_and_resume(six_step_run, data_dir, tmp_path):
    """Killed (-9) after step 5 with checkpoints at 2 and 4, then resumed to 8: metrics.csv holds every
    step once (5 is replayed), the validation at 3 from before the kill and at 6 after, equal to the
    uninterrupted run's, and loss.png is drawn from all of it."""
    overrides = [*SIX_STEPS, "trainer.max_steps=8"]
    env = subprocess_env()
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(data_dir), str(tmp_path / "runs"), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    run_dir = tmp_path / "runs" / RUN_NAME
    before = read_metrics(run_dir)
    assert [s for s, _ in before["train/loss"]] == [1, 2, 3, 4, 5] and [s for s, _ in before["val/loss"]] == [3]
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-00000004.ckpt"

    run_pretrain(tiny_config(data_dir, tmp_path / "runs", *overrides))
    after = read_metrics(run_dir)
    reference = read_metrics(run_pretrain(tiny_config(data_dir, tmp_path / "reference", *overrides)))
    assert [s for s, _ in after["train/loss"]] == list(range(1, 9))
    assert [s for s, _ in after["val/loss"]] == [3, 6]
    for name in ("train/loss", "val/loss"):
        for (step, value), (ref_step, ref_value) in zip(after[name], reference[name]):
            assert step == ref_step and value == pytest.approx(ref_value, abs=1e-6), (name, step)
    assert (run_dir / "loss.png").stat().st_size > 1024
