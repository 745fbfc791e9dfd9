"""The shared callbacks when something around training fails: a plot that cannot be drawn, a validation
callback that raises (the state of the last step is saved first and resumes exactly), an error in the
middle of a step (nothing half-done is saved), and metric files torn by a kill."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from alignment.stages.pretrain import run_pretrain
from tests.alignment.test_pretrain_run import RUN_NAME, read_metrics, tiny_config
from trainer.checkpoints import latest_checkpoint
from trainer.plots import read_metrics_csv

OVERRIDES = ("trainer.max_steps=6", "trainer.val_every_n_steps=3", "checkpoint.every_n_steps=2")


def test_a_failing_plot_is_a_warning_and_the_run_completes(data_dir, tmp_path, monkeypatch):
    import trainer.callbacks

    def broken_plot(*args, **kwargs):
        raise RuntimeError("matplotlib backend exploded")

    monkeypatch.setattr(trainer.callbacks, "plot_curves", broken_plot)
    with pytest.warns(UserWarning, match=r"cannot draw .*loss\.png .*matplotlib backend exploded.*metrics\.csv"):
        run_dir = run_pretrain(tiny_config(data_dir, tmp_path / "runs", *OVERRIDES))
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-00000006.ckpt"
    assert [s for s, _ in read_metrics(run_dir)["train/loss"]] == [1, 2, 3, 4, 5, 6]


class RaiseInValidation(L.Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.at_step:
            raise RuntimeError("evaluation callback bug")


def test_a_validation_callback_raising_saves_the_step_first_and_resumes_exactly(data_dir, tmp_path, caplog):
    runs = tmp_path / "runs"
    with pytest.raises(RuntimeError, match="evaluation callback bug"):
        run_pretrain(tiny_config(data_dir, runs, *OVERRIDES), extra_callbacks=[RaiseInValidation(at_step=3)])
    checkpoints = runs / RUN_NAME / "checkpoints"
    saved = checkpoints / "step-00000003.ckpt"  # not a checkpoint step (every 2): saved because of the error
    assert latest_checkpoint(checkpoints) == saved
    assert f"its state is saved in {saved}" in caplog.text
    assert not (runs / RUN_NAME / "final").exists()

    run_dir = run_pretrain(tiny_config(data_dir, runs, *OVERRIDES))  # fixed: the same command resumes
    reference = run_pretrain(tiny_config(data_dir, tmp_path / "reference", *OVERRIDES))
    resumed = torch.load(checkpoints / "step-00000006.ckpt", map_location="cpu", weights_only=True)
    uninterrupted = torch.load(reference / "checkpoints" / "step-00000006.ckpt", map_location="cpu", weights_only=True)
    for name, tensor in uninterrupted["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], tensor, rtol=0, atol=1e-6)
    losses, reference_losses = read_metrics(run_dir)["train/loss"], read_metrics(reference)["train/loss"]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in read_metrics(run_dir)["val/loss"]] == [3, 6]  # the interrupted validation, once
    assert [v for _, v in losses] == pytest.approx([v for _, v in reference_losses], abs=1e-6)


class RaiseMidStep(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == 3:
            raise RuntimeError("data loader bug")


def test_an_error_inside_a_step_saves_nothing_half_done(data_dir, tmp_path, caplog):
    with pytest.raises(RuntimeError, match="data loader bug"):
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", *OVERRIDES), extra_callbacks=[RaiseMidStep()])
    checkpoints = tmp_path / "runs" / RUN_NAME / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*.ckpt")) == ["step-00000002.ckpt"]
    assert f"the last checkpoint is {checkpoints / 'step-00000002.ckpt'}" in caplog.text


def test_metrics_csv_reader_drops_a_row_torn_by_a_kill(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("metric,step,value\ntrain/loss,1,5.25\nval/loss,1,5.5\ntrain/loss,2,4.12")  # cut mid-number
    assert read_metrics_csv(path) == {"train/loss": [(1, 5.25)], "val/loss": [(1, 5.5)]}
    other = tmp_path / "other.csv"
    other.write_text("name,count,score\na,1,2.0\n")  # not a metrics file: nothing read from it
    assert read_metrics_csv(other) == {}


class RaiseAtBatchEnd(L.Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            raise RuntimeError("logging bug")


@pytest.mark.parametrize(("batch_idx", "saved"), [(5, ["step-00000003.ckpt"]), (4, [])])
def test_an_error_after_a_batch_saves_only_a_closed_accumulation_window(data_dir, tmp_path, batch_idx, saved):
    """With 2 micro-batches a step, the 6th batch closes step 3 (its state is saved on the way out); the 5th
    is half a step (gradients accumulated, no optimizer step): nothing is saved."""
    overrides = ("trainer.max_steps=6", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=100")
    config = tiny_config(data_dir, tmp_path / "runs", *overrides, "trainer.accumulate_grad_batches=2")
    with pytest.raises(RuntimeError, match="logging bug"):
        run_pretrain(config, extra_callbacks=[RaiseAtBatchEnd(batch_idx)])
    checkpoints = tmp_path / "runs" / RUN_NAME / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*.ckpt")) == saved
