"""What keeps a run folder trustworthy: a folder Lantern marked for one stage (never someone else's, never
another stage's), one run at a time per folder (an flock'ed lock file naming its holder, models/folders.py),
atomic training checkpoints (``AtomicCheckpoint``) with a SHA-256 manifest beside each, and finding the newest
checkpoint that verifies and reads as one, whatever the ``latest`` pointer says (it may be stale or missing after
kill -9).
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.tensor import DTensor

from models.atomic import (
    fsync_dir,
    fsync_tree,
    manifest_mismatch,
    remove_path,
    sha256_manifest,
    storage_error,
    write_atomically,
)
from models.checkpoint_io import read_torch_file
from models.errors import CheckpointError, NonFiniteLossError
from models.folders import LOCK_FILE, FolderInUse, FolderNotLanterns, claim_folder, lock_folder, release_folder
from trainer.parallel import first_non_finite, plain_name

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".sha256"
CHECKPOINT_PATTERN = re.compile(r"step-(\d+)\.ckpt")
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
    """Take the run folder's lock for this process, or raise RunFolderInUse naming the holder (models/folders.py)."""
    lock_folder(run_dir, what="run folder", hint="wait for it to finish, stop it, or set run.name to another folder")


def release_run_directory(run_dir: Path) -> None:
    release_folder(run_dir)


RUN_FOLDER = "run folder"
# files only Lantern writes into a run folder: a folder that has one but no marker is an older Lantern's run
# (the pipeline's stage records are alignment/commands/pipeline_records.py's RECORD and PENDING)
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


def has_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` holds any training checkpoint (verified or not): what resume=auto would look at."""
    return directory.is_dir() and any(checkpoint_step(p) is not None for p in directory.iterdir())


# ---------------------------------------------------------------------------------------------------------
# checkpoint manifests


def manifest_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + MANIFEST_SUFFIX)


def write_manifest(written: Path, checkpoint: Path, step: int) -> Path:
    """Hash ``written`` (the temporary a checkpoint was saved to, a file or a shard folder) and write the
    manifest of ``checkpoint`` (its final name) atomically, before the rename: a checkpoint under its final
    name then always has its manifest."""
    manifest = {"format": "lantern-checksums", "version": 1, "step": step, "sha256": sha256_manifest(written)}
    return write_atomically(
        manifest_path(checkpoint), json.dumps(manifest, indent=1) + "\n", what="checkpoint manifest"
    )


def checkpoint_problem(checkpoint: Path) -> str | None:
    """None when ``checkpoint`` matches its manifest; else why not. A checkpoint from before manifests
    existed (none beside it) is accepted, with a warning, as unverifiable."""
    path = manifest_path(checkpoint)
    if not path.is_file():
        if checkpoint.exists():
            warnings.warn(f"checkpoint {checkpoint} has no checksum manifest ({path.name}): using it unverified")
            return training_checkpoint_problem(checkpoint)
        return "missing"
    try:
        expected = json.loads(path.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest {path.name} ({error})"
    return manifest_mismatch(checkpoint, expected) or training_checkpoint_problem(checkpoint)


def read_checkpoint_header(path: Path) -> dict[str, Any]:
    """What a training checkpoint says of itself without reading its tensors (a file is memory-mapped; a shard
    folder's ``meta.pt`` holds it): the dict Lightning saved, with ``hyper_parameters``. A CheckpointError names the
    file and the cause: a pickle of Python objects is refused (never loaded), a model's weights are not a training
    checkpoint, anything else unreadable is damaged."""
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"{path} is a folder but not a sharded training checkpoint (no .metadata)")
        header = read_torch_file(path / _METADATA_FILENAME, mmap=True)
    else:
        header = read_torch_file(path, mmap=True)
        if isinstance(header, dict) and "state_dict" not in header:
            raise CheckpointError(
                f"{path} holds {'model weights' if header else 'an empty dict'}, not a training checkpoint (no "
                "state_dict, optimizer or loop state): start from a model with init.checkpoint instead"
            )
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a training checkpoint (it holds a {type(header).__name__})")
    return header


def training_checkpoint_problem(path: Path) -> str | None:
    """None when ``path`` reads as a training checkpoint; else why not (see ``read_checkpoint_header``)."""
    try:
        read_checkpoint_header(path)
    except CheckpointError as error:
        return str(error)
    return None


def checkpoint_step(path: Path) -> int | None:
    match = CHECKPOINT_PATTERN.fullmatch(path.name)
    return int(match.group(1)) if match else None


def newest_verified_checkpoint(directory: Path) -> Path | None:
    """The newest ``step-*.ckpt`` in ``directory`` that matches its manifest. Newer ones that do not
    (truncated, bit-flipped, half-renamed) are skipped with a warning naming them; ``latest`` is not
    trusted, since a kill between a checkpoint's rename and the pointer's update leaves it stale."""
    if not directory.is_dir():
        return None
    candidates = sorted(
        (p for p in directory.iterdir() if checkpoint_step(p) is not None), key=checkpoint_step, reverse=True
    )
    for candidate in candidates:
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate
        warnings.warn(f"skipping checkpoint {candidate}: {problem}; trying an older one")
    return None


def remove_checkpoint(checkpoint: Path) -> None:
    """A checkpoint and its manifest (the checkpoint first: a manifest alone is never mistaken for one)."""
    remove_path(checkpoint)
    manifest_path(checkpoint).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------
# training checkpoints


LATEST = "latest"  # a file naming the newest complete checkpoint, for people: resume scans and verifies instead


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
        # saved. Under several ranks only when they all stop at that step (trainer/stopping.py's StopTogether): every
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
        """Manifest, rename, pointer, pruning; in that order, so that whatever a kill interrupts, every
        checkpoint under its final name is complete and has its manifest (resume does not trust ``latest``)."""
        fsync_tree(temporary)
        write_manifest(temporary, final, step)
        if final.is_dir():  # saved at this step before, as shards: a folder cannot be replaced in one rename
            remove_path(final)
        os.replace(temporary, final)
        write_atomically(self.directory / LATEST, final.name + "\n", what="checkpoint pointer")
        fsync_dir(self.directory)
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


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint in ``directory`` that verifies against its checksum manifest, or None (see
    ``trainer.storage.newest_verified_checkpoint``)."""
    return newest_verified_checkpoint(Path(directory))
