"""Host reads of tensor values during training: on a GPU each one (``item``, ``tolist``, ``float(t)``, ``bool(t)``)
waits for every kernel queued before it, so the GPU idles while the CPU catches up. A training step may read one
value (the NaN/Inf check of the step, ``LanguageModelModule.check_finite_step``); the progress bar, the plots and
the loggers read theirs every ``trainer.log_every_n_steps`` optimizer steps, never every micro-batch. Counted on
CPU by patching those methods of ``torch.Tensor``, per optimizer step."""

from __future__ import annotations

import os
import sys

import lightning as L
import pytest
import torch

from alignment.stages.pretrain import run_pretrain
from models.errors import NonFiniteLossError
from tests.alignment.test_pretrain_run import RUN_NAME, read_metrics, tiny_config
from trainer.checkpoints import latest_checkpoint
from trainer.plots import read_metrics_csv

READS = ("item", "tolist", "__float__", "__int__", "__bool__")
# CPU tensors on every device, read at no device sync: AdamW's step counters (not capturable) and the DataLoader's
# seed for a new pass over the data
HOST_SIDE = (f"torch{os.sep}optim{os.sep}", f"torch{os.sep}utils{os.sep}data{os.sep}")
EVERY = 4  # trainer.log_every_n_steps
STEPS = 9  # steps 1..8 are counted whole (the last one's window ends in the run's end: final save, export)
PER_STEP = 1  # the step's NaN/Inf check
PER_LOGGING_STEP = 10  # the logger's values (loss, grad norm, lr, tokens, tokens/s, MFU), the bar's, the plot's


class HostReads(L.Callback):
    """Counts the host reads of tensor values from one micro-batch's start to the next's, by the optimizer step
    (1-based) the micro-batch belongs to; reads of ``HOST_SIDE`` tensors are not counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.counting = 0, False
        self.marks: list[tuple[int, int]] = []  # (global step, reads so far) at each micro-batch's start
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, read):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.counting and not any(part in caller for part in HOST_SIDE):
                self.count += 1
            return read(tensor, *args, **kwargs)

        return counted

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        self.counting = True
        self.marks.append((trainer.global_step, self.count))

    def per_step(self) -> dict[int, int]:
        """Reads by optimizer step, for the steps whose window closed (the next step's first micro-batch began)."""
        steps: dict[int, int] = {}
        for (step, start), (_, end) in zip(self.marks, self.marks[1:]):
            steps[step + 1] = steps.get(step + 1, 0) + end - start
        last = self.marks[-1][0] + 1
        return {step: reads for step, reads in steps.items() if step < last}


def assert_reads_follow_the_logging_cadence(reads: dict[int, int]) -> None:
    assert sorted(reads) == list(range(1, STEPS)), reads
    for step, count in reads.items():
        bound = PER_STEP + (PER_LOGGING_STEP if step % EVERY == 0 else 0)
        assert count <= bound, f"{count} host reads in optimizer step {step} (at most {bound}): {reads}"


@pytest.mark.parametrize("accumulate", [2, 4])
def test_pretraining_reads_the_host_once_a_step_and_logs_every_n_steps(data_dir, tmp_path, monkeypatch, accumulate):
    """However many micro-batches a step has: one read a step, the logging steps' reads every ``EVERY`` steps; and
    ``metrics.csv`` still holds every step's loss (the plot's points are read in batches, not dropped)."""
    reads = HostReads(monkeypatch)
    config = tiny_config(
        data_dir, tmp_path / "runs",
        f"trainer.max_steps={STEPS}", f"trainer.accumulate_grad_batches={accumulate}",
        f"trainer.log_every_n_steps={EVERY}", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=100",
    )  # fmt: skip
    run_dir = run_pretrain(config, extra_callbacks=[reads])
    assert_reads_follow_the_logging_cadence(reads.per_step())
    steps = [step for step, _ in read_metrics(run_dir)["train/loss"]]
    assert [step for step in steps if step > 0] == list(range(1, STEPS + 1))


def test_sft_reads_the_host_once_a_step_and_logs_every_n_steps(tmp_path, monkeypatch):
    from alignment.stages.sft import run_sft
    from data.demo.tasks import write_demo_dataset
    from tests.alignment.test_sft import sft_config

    demo = write_demo_dataset(tmp_path / "demo", n_train=120, n_val=8, n_pairs=4, seed=0)
    reads = HostReads(monkeypatch)
    config = sft_config(
        demo, tmp_path / "runs",
        f"trainer.max_steps={STEPS}", "trainer.accumulate_grad_batches=3", f"trainer.log_every_n_steps={EVERY}",
        "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=100", "logger.kind=csv", "loader.micro_batch_size=2",
    )  # fmt: skip
    run_dir = run_sft(config, extra_callbacks=[reads])
    assert_reads_follow_the_logging_cadence(reads.per_step())
    assert [step for step, _ in read_metrics_csv(run_dir / "metrics.csv")["train/loss"]] == list(range(1, STEPS + 1))


class CheckpointedRowsOnDisk(L.Callback):
    """At each micro-batch's start: the rows of every step up to the newest checkpoint are in metrics.csv already
    (a kill now, and the resumed run, which starts after that checkpoint, would never record them again)."""

    def __init__(self, run_dir) -> None:
        self.run_dir, self.checked = run_dir, 0

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        saved = latest_checkpoint(self.run_dir / "checkpoints")
        if saved is None:
            return
        step = int(saved.stem.split("-")[1])
        rows = {s for s, _ in read_metrics_csv(self.run_dir / "metrics.csv").get("train/loss", [])}
        assert set(range(1, step + 1)) <= rows, f"checkpoint of step {step} published, metrics.csv has steps {rows}"
        self.checked += 1


def test_rows_are_on_disk_before_their_checkpoint_is(data_dir, tmp_path):
    """Plot points wait for the next logging step, but never past a checkpoint that covers them."""
    config = tiny_config(
        data_dir, tmp_path / "runs",
        "trainer.max_steps=7", "trainer.log_every_n_steps=5", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=3",
    )  # fmt: skip
    check = CheckpointedRowsOnDisk(tmp_path / "runs" / RUN_NAME)
    run_pretrain(config, extra_callbacks=[check])
    assert check.checked >= 2  # after the checkpoints of steps 3 and 6


class PoisonMicroBatch(L.Callback):
    """A NaN loss in the first micro-batch of optimizer step ``at_step`` (a weight is NaN during that micro-batch
    only); records every weight before that step and after it."""

    def __init__(self, at_step: int) -> None:
        self.at_step, self.poisoned = at_step, False
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step and not self.before:
            self.before = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
            with torch.no_grad():
                pl_module.model.norm.weight.fill_(float("nan"))
            self.poisoned = True

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if self.poisoned:
            with torch.no_grad():
                pl_module.model.norm.weight.copy_(self.before["norm.weight"])
            self.poisoned = False
        elif self.before and not self.after and trainer.global_step > self.at_step:
            self.after = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}


def test_a_nan_micro_batch_stops_the_run_at_its_step(data_dir, tmp_path):
    """Checked once a step: a NaN in the first of two micro-batches still stops the run at that step."""
    config = tiny_config(
        data_dir, tmp_path / "runs",
        "trainer.max_steps=4", "trainer.accumulate_grad_batches=2", "trainer.val_every_n_steps=100",
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=r"^loss is nan at step 2: training stopped"):
        run_pretrain(config, extra_callbacks=[PoisonMicroBatch(at_step=2)])


def test_a_nan_micro_batch_skips_its_step_under_max_nonfinite_steps(data_dir, tmp_path, caplog):
    poison = PoisonMicroBatch(at_step=2)
    config = tiny_config(
        data_dir, tmp_path / "runs",
        "trainer.max_steps=4", "trainer.accumulate_grad_batches=2", "trainer.val_every_n_steps=100",
        "trainer.max_nonfinite_steps=1",
    )  # fmt: skip
    run_pretrain(config, extra_callbacks=[poison])
    assert "loss is nan at step 2: step skipped (1 of trainer.max_nonfinite_steps=1 in a row)" in caplog.text
    assert poison.after, "the step after the poisoned one never ended"
    for name, tensor in poison.before.items():
        assert torch.equal(poison.after[name], tensor), f"{name} changed in the skipped step"
