"""kill -9 at a chosen point of a real ``lantern`` run, for tests/faults/test_kill.py.

``python -m tests.faults.killing ARGS`` is ``lantern ARGS`` (alignment.commands.cli.main) with hooks that SIGKILL the
run's whole process group (every rank Lightning's launcher started) when it reaches the point named by
``LANTERN_TEST_KILL_AT`` (``PHASE@STEP`` or ``PHASE@STEP@RANK``, STEP being ``trainer.global_step`` there,
RANK the global rank that fires, 0 by default). The run being killed from inside at an exact point, rather
than by a timer outside, is what makes each kill point reproducible; what it leaves on disk is what a kill
-9 from outside at that instant leaves. Without the variable it is a plain ``lantern`` run. Lightning
re-launches ``python -m tests.faults.killing ARGS`` for the other ranks, so every rank has the hooks.

Before killing, the firing process appends ``PHASE STEP RANK`` to ``LANTERN_TEST_KILL_LOG`` (if set), so a
test can tell the planned kill from any other death.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from alignment.commands.cli import main as lantern
from trainer import storage
from trainer.callbacks import SkipNonFiniteSteps

KILL_AT = "LANTERN_TEST_KILL_AT"
KILL_LOG = "LANTERN_TEST_KILL_LOG"
_GROUP = "LANTERN_TEST_KILL_GROUP"  # the process group to kill: the one the first (rank 0) process leads

# Where a run can be killed, in the order a step reaches them.
TRAINING_PHASES = (
    "before-update",  # backward done, the optimizer step not yet taken (SkipNonFiniteSteps.on_before_optimizer_step)
    "after-update",  # the optimizer step taken, its checkpoint (if one is due) not yet started
)
CHECKPOINT_PHASES = (
    "ckpt-partial",  # the temporary checkpoint half written: a file truncated, or one shard of a folder missing
    "ckpt-written",  # every rank's temporary complete, no manifest yet
    "ckpt-manifest",  # the manifest under the final name written, the temporary not yet renamed
    "ckpt-renamed",  # renamed into place, the `latest` pointer still names the previous checkpoint
    "ckpt-pointer",  # `latest` updated, older checkpoints not yet pruned
)


@dataclass(frozen=True)
class KillPoint:
    phase: str
    step: int
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.phase}@{self.step}@{self.rank}"

    @classmethod
    def parse(cls, text: str) -> KillPoint:
        phase, step, *rank = text.split("@")
        if phase not in TRAINING_PHASES + CHECKPOINT_PHASES or len(rank) > 1:
            raise ValueError(
                f"{KILL_AT}={text!r}: expected PHASE@STEP[@RANK] with PHASE one of {TRAINING_PHASES + CHECKPOINT_PHASES}"
            )
        return cls(phase, int(step), int(rank[0]) if rank else 0)


def kill_plan(seed: int, kills: int, max_steps: int, every_n_steps: int, ranks: int = 1) -> list[KillPoint]:
    """``kills`` kill points at strictly increasing steps in 1..max_steps (so each is reached again after the
    previous kill's resume, which goes back at most to that step), the first ``kills - 1`` in checkpoint
    writing and the last in training, the phases, steps and ranks drawn from ``random.Random(seed)``. Phases
    that only rank 0 runs (publishing a checkpoint) always fire on rank 0."""
    rng = random.Random(seed)
    saves = list(range(every_n_steps, max_steps + 1, every_n_steps))
    if len(saves) < kills - 1:
        raise ValueError(f"{kills - 1} checkpoint kills need as many saves, {max_steps} steps make {len(saves)}")
    while True:  # checkpoint steps first, then a training step after the last of them
        steps = sorted(rng.sample(saves, kills - 1))
        if not steps or steps[-1] < max_steps:
            break
    training_step = rng.randint((steps[-1] if steps else 0) + 1, max_steps)
    plan = []
    for step in steps:
        phase = rng.choice(CHECKPOINT_PHASES)
        rank = rng.randrange(ranks) if phase in ("ckpt-partial", "ckpt-written") else 0
        plan.append(KillPoint(phase, step, rank))
    phase = rng.choice(TRAINING_PHASES)
    # before-update at global_step k is in the batch that makes step k+1: k ranges over 0..max_steps-1
    plan.append(
        KillPoint(phase, training_step - 1 if phase == "before-update" else training_step, rng.randrange(ranks))
    )
    return plan


def kill_group(point: KillPoint, rank: int) -> None:
    """Record the kill, then SIGKILL the run's process group, this process included."""
    log = os.environ.get(KILL_LOG)
    if log:
        with open(log, "a") as handle:
            handle.write(f"{point.phase} {point.step} {rank}\n")
            handle.flush()
            os.fsync(handle.fileno())
    os.killpg(int(os.environ[_GROUP]), signal.SIGKILL)


def damage_temporary(temporary: Path) -> None:
    """What a kill part-way through writing a checkpoint leaves: the first half of a file, or a shard folder
    with one shard missing and another cut in half."""
    if temporary.is_dir():
        shards = sorted(temporary.glob("*.distcp"))
        shards[-1].unlink()
        files = [p for p in temporary.rglob("*") if p.is_file()]
    else:
        files = [temporary]
    for path in files[:1]:
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)


def install(point: KillPoint) -> None:
    """Wrap the Lantern and Lightning functions each phase happens in (see TRAINING_PHASES, CHECKPOINT_PHASES)."""
    saving = {"step": -1}  # the step of the checkpoint being saved, and its temporary

    def fire(phase: str, step: int, rank: int) -> None:
        if (phase, step, rank) == (point.phase, point.step, point.rank):
            kill_group(point, rank)

    def wrap(owner: Any, name: str, before: Callable | None = None, after: Callable | None = None) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before:
                before(*args, **kwargs)
            result = original(*args, **kwargs)
            if after:
                after(*args, **kwargs)
            return result

        setattr(owner, name, wrapper)

    def before_update(self, trainer, *args: Any) -> None:
        fire("before-update", trainer.global_step, trainer.global_rank)

    def after_update(self, trainer, *args: Any) -> None:
        fire("after-update", trainer.global_step, trainer.global_rank)

    def start_save(self, trainer) -> None:
        saving["step"] = trainer.global_step

    def saved_temporary(trainer, path, *args: Any, **kwargs: Any) -> None:
        if (point.phase, saving["step"], trainer.global_rank) == ("ckpt-partial", point.step, point.rank):
            damage_temporary(Path(path))
            kill_group(point, trainer.global_rank)

    wrap(SkipNonFiniteSteps, "on_before_optimizer_step", before=before_update)
    wrap(storage.AtomicCheckpoint, "on_train_batch_end", before=after_update)
    wrap(storage.AtomicCheckpoint, "save", before=start_save)
    wrap(L.Trainer, "save_checkpoint", after=saved_temporary)
    # _publish runs on global rank 0 only
    wrap(
        storage,
        "write_manifest",
        before=lambda *a: fire("ckpt-written", saving["step"], 0),
        after=lambda *a: fire("ckpt-manifest", saving["step"], 0),
    )
    wrap(
        storage,
        "write_atomically",
        before=lambda path, *a, **k: (
            fire("ckpt-renamed", saving["step"], 0) if Path(path).name == storage.LATEST else None
        ),
    )
    wrap(storage.AtomicCheckpoint, "_prune", before=lambda self: fire("ckpt-pointer", saving["step"], 0))


def main() -> int:
    spec = os.environ.get(KILL_AT)
    if spec:
        if _GROUP not in os.environ:  # the first process: it must lead its own group, or killpg would reach further
            if os.getpgrp() != os.getpid():
                raise SystemExit(f"{KILL_AT} needs the run started in its own process group (start_new_session=True)")
            os.environ[_GROUP] = str(os.getpgrp())
        install(KillPoint.parse(spec))
    return lantern(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
