"""NaN/Inf losses under ``trainer.max_nonfinite_steps``: a skipped step changes nothing (no weight or
optimizer-state update), too many in a row stop the run with the last good checkpoint kept, and a bad
value of the key is a one-line config error before any compute."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from alignment.stages.pretrain import run_pretrain
from models.errors import ConfigError, NonFiniteLossError
from tests.alignment.test_pretrain_run import RUN_NAME, tiny_config
from trainer.checkpoints import latest_checkpoint


class PoisonOneBatch(L.Callback):
    """Makes the loss NaN for the batch of optimizer step ``at_step`` only (a weight is NaN during that
    batch and restored after it), and records every weight before that batch and after it."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step and not self.before:
            self.before = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
            with torch.no_grad():
                pl_module.model.norm.weight.fill_(float("nan"))

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self.before and not self.after:
            with torch.no_grad():
                pl_module.model.norm.weight.copy_(self.before["norm.weight"])
            self.after = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}


def test_a_skipped_step_changes_no_weight_and_no_optimizer_state(data_dir, tmp_path, caplog):
    poison = PoisonOneBatch(at_step=2)
    overrides = [
        "trainer.max_steps=4",
        "trainer.val_every_n_steps=100",
        "checkpoint.every_n_steps=100",
        "trainer.max_nonfinite_steps=1",
    ]
    run_dir = run_pretrain(tiny_config(data_dir, tmp_path / "runs", *overrides), extra_callbacks=[poison])
    assert "loss is nan at step 2: step skipped (1 of trainer.max_nonfinite_steps=1 in a row)" in caplog.text
    assert poison.after, "the poisoned batch never ended"
    for name, tensor in poison.before.items():
        assert torch.equal(poison.after[name], tensor), f"{name} changed in the skipped step"
    last = torch.load(latest_checkpoint(run_dir / "checkpoints"), map_location="cpu", weights_only=True)
    assert last["global_step"] == 4  # the skipped step counts (the schedule advanced) ...
    adam_steps = {float(state["step"]) for state in last["optimizer_states"][0]["state"].values()}
    assert adam_steps == {3.0}  # ... but AdamW updated 3 times, not 4
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())
    assert (run_dir / "final" / "model.safetensors").is_file()


class PoisonFrom(L.Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.at_step:
            with torch.no_grad():
                pl_module.model.norm.weight.fill_(float("nan"))


def test_too_many_non_finite_steps_in_a_row_stop_with_the_last_good_checkpoint(data_dir, tmp_path):
    overrides = [
        "trainer.max_steps=8",
        "trainer.val_every_n_steps=100",
        "checkpoint.every_n_steps=2",
        "trainer.max_nonfinite_steps=2",
    ]
    with pytest.raises(
        NonFiniteLossError, match=r"at step 5 after 2 skipped in a row \(trainer.max_nonfinite_steps=2\)"
    ) as error:
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", *overrides), extra_callbacks=[PoisonFrom(at_step=3)])
    checkpoints = tmp_path / "runs" / RUN_NAME / "checkpoints"
    assert f"{checkpoints / 'step-00000002.ckpt'} is the last good step and a rerun resumes" in str(error.value)
    # step 4 was reached by a skipped step (weights NaN here): not saved; the good step-2 checkpoint stays
    assert sorted(p.name for p in checkpoints.glob("step-*.ckpt")) == ["step-00000002.ckpt"]
    good = torch.load(latest_checkpoint(checkpoints), map_location="cpu", weights_only=True)
    assert all(torch.isfinite(t).all() for t in good["state_dict"].values())
    assert not (tmp_path / "runs" / RUN_NAME / "final").exists()


def test_negative_max_nonfinite_steps_is_a_config_error_before_any_compute(data_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.max_nonfinite_steps must be >= 0 .* got -1"):
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", "trainer.max_nonfinite_steps=-1"))
    assert not (tmp_path / "runs" / RUN_NAME).exists()
