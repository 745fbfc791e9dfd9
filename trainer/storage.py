"""Run folders (marked for one stage, one run at a time) and the callback that saves training checkpoints
atomically (``AtomicCheckpoint``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.tensor import DTensor

from models.errors import NonFiniteLossError
from models.files.atomic import remove_path, rename_into_place, storage_error, write_atomically
from models.files.folders import LOCK_FILE, FolderInUse, FolderNotLanterns, claim_folder, lock_folder, release_folder
from trainer.checkpoints import (
    LATEST,
    MANIFEST_SUFFIX,
    checkpoint_step,
    manifest_path,
    remove_checkpoint,
    write_manifest,
)
from trainer.parallel import first_non_finite, plain_name

log = logging.getLogger(__name__)

RunFolderInUse = FolderInUse  # another live process holds the run folder's lock


def is_global_rank_zero() -> bool:
    """Whether this process is (or, before the process group exists, will be) global rank 0, from the
    variables torchrun, SLURM and Lightning's launcher set; a plain single process is rank 0."""
    for variable in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(variable):
            return int(os.environ[variable]) == 0
    node = int(os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK") or 0)
    return node == 0 and int(os.environ.get("LOCAL_RANK") or 0) == 0


def lock_run_directory(run_dir: Path) -> None:
    """Take the run folder's lock for this process, or raise RunFolderInUse naming the holder."""
    lock_folder(run_dir, what="run folder", hint="wait for it to finish, stop it, or set run.name to another folder")


def release_run_directory(run_dir: Path) -> None:
    release_folder(run_dir)


RUN_FOLDER = "run folder"
# files only Lantern writes into a run folder (its lock, the pipeline's stage records): a folder that has one but no
# marker is an older Lantern's run
_RUN_RECORDS = (LOCK_FILE, "pipeline_stage.json", "pipeline_stage.pending.json")


def claim_run_directory(run_dir: Path, stage: str) -> None:
    """Make ``run_dir`` this stage's run folder: a new or empty folder is marked with the stage; one Lantern marked
    for the same stage is reused (resumed); anything else is refused in one line naming run.name, before anything in
    the folder changes: a folder holding files Lantern did not write (they would be overwritten: config.yaml,
    metrics.csv, checkpoints/...) or another stage's run (whose checkpoints this stage would try to resume)."""
    record = claim_folder(
        run_dir,
        RUN_FOLDER,
        key="run.name",
        record={"stage": stage},
        adopt=lambda folder: any((folder / name).exists() for name in _RUN_RECORDS),
    )
    if record.get("stage") != stage:
        raise FolderNotLanterns(
            f"run.name: {run_dir} holds a {record.get('stage')} run, not a {stage} run; each stage trains in its "
            "own folder: set run.name to another one"
        )


# ---------------------------------------------------------------------------------------------------------
# training checkpoints


class AtomicCheckpoint(L.Callback):
    """Saves every ``every_n_steps`` optimizer steps and at the end, so that a crash never corrupts the last
    good checkpoint: each save goes to a hidden temporary path (a file, or a folder of shards under FSDP),
    its SHA-256 manifest is written, it is renamed into place once every rank has written, and only then does
    ``latest`` point at it. A full or read-only disk stops the run with one line naming the checkpoint that
    is still good; the temporary is removed.

    When a run stops on an error that is not the model's (a callback, validation, logging or plotting
    raising) between two optimizer steps, the state of the last step is saved before the error is passed on,
    so no training is lost (single process: under several, the other ranks may not be there to save)."""

    def __init__(self, directory: str | Path, every_n_steps: int, keep_last: int = 3) -> None:
        if every_n_steps < 1 or keep_last < 1:
            raise ValueError("checkpoint.every_n_steps and checkpoint.keep_last must be >= 1")
        self.directory = Path(directory)
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self._last_saved_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                for stale in self.directory.glob(".tmp-*"):  # left by a crash mid-save: never a good checkpoint
                    remove_path(stale)
                for manifest in self.directory.glob(f"step-*.ckpt{MANIFEST_SUFFIX}"):  # killed before the rename
                    if not manifest.with_name(manifest.name.removesuffix(MANIFEST_SUFFIX)).exists():
                        manifest.unlink()
            except OSError as error:
                raise storage_error(error, self.directory, "checkpoint folder") from error
        trainer.strategy.barrier("atomic-checkpoint-setup")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path:  # resumed: the checkpoint of this step exists, saving it again would only rewrite it
            self._last_saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        skipped = getattr(pl_module, "skip_step", None) == step - 1  # a NaN/Inf step: the weights may be bad
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_saved_step and not skipped:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_saved_step and not getattr(pl_module, "failed", False):
            self.save(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        unsaved = trainer.global_step > max(self._last_saved_step, 0)
        # SIGTERM (a scheduler's preemption): Lightning stops after the step's last hook, so its state is whole and is
        # saved. Under several ranks only when they all stop at that step (StopTogether): every
        # rank is then here at the same point and writes its part, the collectives of the save matched.
        together = trainer.world_size == 1 or getattr(trainer.strategy, "stop_agreed", False)
        sigterm = isinstance(exception, SIGTERMException) and together
        # Not after the model's own failure (NaN), a disk error, Ctrl-C (it can land inside a step), nor mid-step
        # (the data of the step under way is already counted as consumed); under several ranks, nothing but an agreed
        # SIGTERM (after another error, the other ranks may not be there to save).
        if (
            not unsaved
            or getattr(pl_module, "failed", False)
            or not (isinstance(exception, Exception) or sigterm)
            or isinstance(exception, OSError)
            or not self._between_steps(trainer)
            or (trainer.world_size > 1 and not sigterm)
        ):
            if not trainer.is_global_zero:
                return
            if sigterm and self._last_saved_step == trainer.global_step > 0:  # it landed just after a save
                log.error("stopped by SIGTERM at step %d; its state is saved in %s", trainer.global_step,
                          self._path(self._last_saved_step))  # fmt: skip
            elif self._last_saved_step > 0:
                log.error(
                    "training stopped (%s); the last checkpoint is %s",
                    type(exception).__name__,
                    self._path(self._last_saved_step),
                )
            return
        try:
            path = self.save(trainer)
        except Exception as error:
            log.error("training stopped (%r) and saving its state failed too (%r)", exception, error)
            return
        if not trainer.is_global_zero:
            return
        if sigterm:
            log.error("stopped by SIGTERM at step %d; its state is saved in %s", trainer.global_step, path)
            return
        log.error(
            "training stopped at step %d (%s: %s); its state is saved in %s: fix the cause and run the same "
            "command again to resume from it",
            trainer.global_step,
            type(exception).__name__,
            exception,
            path,
        )

    def _between_steps(self, trainer: L.Trainer) -> bool:
        """The batch fetched last has been fully processed and it closed a gradient-accumulation window, so the
        weights, optimizer and data position agree. Read from the loop's progress counters rather than from
        this callback's own hooks, which a callback listed before it can pre-empt by raising."""
        batches = trainer.fit_loop.epoch_loop.batch_progress
        processed = batches.current.ready > 0 and batches.current.processed == batches.current.ready
        window_closed = batches.current.ready % trainer.accumulate_grad_batches == 0 or batches.is_last_batch
        return processed and window_closed

    def _path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.ckpt"

    def save(self, trainer: L.Trainer) -> Path:
        step = trainer.global_step
        final = self._path(step)
        self._refuse_non_finite(trainer, step)
        temporary = final.with_name(f".tmp-{final.name}")
        error: OSError | None = None
        try:
            trainer.save_checkpoint(temporary, weights_only=False)  # full state: optimizer, schedule, loops
        except OSError as caught:  # this rank's write failed: the others must hear of it, not wait for it
            error = caught
        written = trainer.strategy.reduce_boolean_decision(error is None, all=True)
        if trainer.is_global_zero:
            try:
                if written:
                    self._publish(temporary, final, step)
                    # published and verified: the last checkpoint, even if a peer dies in the collective below
                    self._last_saved_step = step
            except OSError as caught:
                error, written = caught, False
            if not written:
                remove_path(temporary)
                if not final.exists():
                    manifest_path(final).unlink(missing_ok=True)
        if not trainer.strategy.reduce_boolean_decision(written, all=True):
            previous = self._path(self._last_saved_step) if self._last_saved_step > 0 else None
            kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint of this run"
            cause = error or OSError(0, "another rank could not write its part")
            raise storage_error(cause, final, "checkpoint", kept=kept + ", the temporary was removed") from error
        self._last_saved_step = step
        if trainer.is_global_zero:
            for logger in trainer.loggers:  # as Lightning's ModelCheckpoint does (W&B: logger.log_model=all)
                logger.after_save_checkpoint(self)
        return final

    def _refuse_non_finite(self, trainer: L.Trainer, step: int) -> None:
        """Never write a checkpoint holding a NaN/Inf weight or optimizer state (a finite loss can still end in
        such an update): the run stops instead, with ``failed`` set, and the newest checkpoint stays the last
        good one, which a rerun resumes from."""
        bad = non_finite_tensor(trainer)
        if bad is None:
            return
        trainer.lightning_module.failed = True
        previous = self._path(self._last_saved_step) if self._last_saved_step > 0 else None
        kept = f"the last good checkpoint is {previous}" if previous else "no earlier checkpoint of this run"
        raise NonFiniteLossError(
            f"{bad} is not finite after step {step}: its checkpoint was not written and training stopped; {kept}, "
            "and a rerun resumes from it (lower optim.lr, enable optim.grad_clip or check the data)"
        )

    @property
    def last_saved(self) -> Path | None:
        """The checkpoint this run published last (or resumed from), if any."""
        return self._path(self._last_saved_step) if self._last_saved_step > 0 else None

    def _publish(self, temporary: Path, final: Path, step: int) -> None:
        """Manifest, rename, pointer, pruning; in that order, so that whatever a kill interrupts, every checkpoint
        under its final name is complete and has its manifest (resume does not trust ``latest``)."""
        write_manifest(temporary, final, step)
        rename_into_place(temporary, final)  # a folder of shards saved at this step before is replaced
        write_atomically(self.directory / LATEST, final.name + "\n", what="checkpoint pointer")
        self._prune()

    def _prune(self) -> None:
        checkpoints = sorted(p for p in self.directory.glob("step-*.ckpt") if checkpoint_step(p) is not None)
        for old in checkpoints[: -self.keep_last]:
            remove_checkpoint(old)


def non_finite_tensor(trainer: L.Trainer) -> str | None:
    """The name of a trained parameter or optimizer state of the run holding a NaN/Inf (every rank's shard
    checked; all ranks get the same answer), or None. One host read, one all-reduce under several ranks."""
    named = [(name, p) for name, p in trainer.lightning_module.named_parameters() if p.requires_grad]
    for index, optimizer in enumerate(trainer.optimizers):
        for state in optimizer.state.values():
            named += [(f"optimizer {index} state {key}", v) for key, v in state.items() if _is_float_tensor(v)]
    local = [(name, t.to_local() if isinstance(t, DTensor) else t) for name, t in named]
    if not local:
        return None
    first = first_non_finite([t for _, t in local], trainer)  # the same tensors, in order, on every rank
    return None if first is None else plain_name(local[first][0])


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()
