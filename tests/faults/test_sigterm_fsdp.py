"""SIGTERM to a 2-process FSDP2 run (``lantern sft``, gloo on CPU), sent to the main process only or to the whole
process group, as schedulers do before they kill: every process ends with 143 within a bound, the ranks stop
together at one optimizer step and save it, and the same command resumes it exactly (the losses and weights of an
uninterrupted run). A rank that cannot reach that step (stopped) does not hold the run: 143 at the deadline, without
saving, naming the last checkpoint, no rank left behind. Before: the run hung (Lightning's handler runs a broadcast
inside the signal handler that the other rank never matches), or, when it did exit, saved nothing.

``python -m tests.faults.test_sigterm_fsdp ARGS`` is ``lantern ARGS``; with ``LANTERN_TEST_SIGTERM=STEP@RANK@HOW``,
rank RANK, at the end of step STEP (its checkpoint published), sends SIGTERM to the main process (``main``), to the
process group (``group``), or stops itself (``stop``: SIGSTOP, the test signals from outside), after appending
``PID TIME`` to ``LANTERN_TEST_SIGTERM_LOG``. Lightning relaunches this module for the other rank: both have the hook.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.faults.test_signals import EXIT, RUN_TIMEOUT, named_checkpoint, run_again, the_line
from tests.trainer.test_distributed import assert_same_weights, environment, final_weights, train_losses
from trainer.stopping import STOP_GRACE_S

pytestmark = pytest.mark.slow  # every case is a few real 2-process runs

ROOT = Path(__file__).resolve().parents[2]
SIGTERM_AT, SIGTERM_LOG, MAIN_PID = "LANTERN_TEST_SIGTERM", "LANTERN_TEST_SIGTERM_LOG", "LANTERN_TEST_MAIN_PID"
STEPS, SIGNAL_STEP = 8, 2  # checkpoints every 2 steps: the signal comes right after the first one
BOUND_S = 40  # how soon after the signal every process must be gone (agreed stop: ~5 s; a stopped rank: the 25 s grace)
HANG_S = 120  # past this the run is taken to hang: it is killed and the test fails
LORA = ("peft.kind=lora", "peft.rank=4", "peft.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=1")


def install(spec: str) -> None:
    """The hook (see the module docstring), after AtomicCheckpoint's own step end."""
    from trainer import storage

    step, rank, how = spec.split("@")
    os.environ.setdefault(MAIN_PID, str(os.getpid()))  # set by the first process, inherited by the ranks it launches
    original = storage.AtomicCheckpoint.on_train_batch_end

    def on_train_batch_end(self: Any, trainer: Any, *args: Any) -> None:
        original(self, trainer, *args)
        if (trainer.global_step, trainer.global_rank) != (int(step), int(rank)):
            return
        with open(os.environ[SIGTERM_LOG], "a") as log:
            log.write(f"{os.getpid()} {time.time()}\n")
        if how == "main":
            os.kill(int(os.environ[MAIN_PID]), signal.SIGTERM)
        elif how == "group":
            os.killpg(os.getpgrp(), signal.SIGTERM)
        else:
            os.kill(os.getpid(), signal.SIGSTOP)

    storage.AtomicCheckpoint.on_train_batch_end = on_train_batch_end


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    from data.demo.tasks import write_demo_dataset

    return write_demo_dataset(tmp_path_factory.mktemp("demo"), n_train=300, n_val=40, n_pairs=10, seed=0)


def sft_command(demo: dict[str, Path], out_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "tests.faults.test_sigterm_fsdp", "sft", str(ROOT / "configs/sft/tiny.yaml"),
        f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]", f"run.out_dir={out_dir}", "run.name=run",
        f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=2", "checkpoint.keep_last=5",
        "trainer.val_every_n_steps=1000", "eval.generations=0", "trainer.accelerator=cpu", "trainer.strategy=fsdp",
        "trainer.devices=2", "loader.micro_batch_size=2", *overrides,
    ]  # fmt: skip


def alive_in_group(group: int) -> list[int]:
    """The processes of process group ``group`` that still run (zombies are gone: they only wait to be reaped)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def state(pid: int) -> str:
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]


class Run:
    """A run started in its own session (its ranks in its process group), with the hook set to ``spec``."""

    def __init__(self, args: list[str], spec: str, tmp_path: Path) -> None:
        self.log, self.stderr = tmp_path / "sigterm.log", tmp_path / "interrupted.err"
        env = {**environment(), SIGTERM_AT: spec, SIGTERM_LOG: str(self.log)}
        with open(self.stderr, "w") as err:
            self.process = subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True
            )

    def fired(self, timeout: float = RUN_TIMEOUT) -> tuple[int, float]:
        """(pid, time) of the hook's firing, once it has (the run started and trained SIGNAL_STEP steps)."""
        deadline = time.monotonic() + timeout
        while not (self.log.is_file() and self.log.read_text().endswith("\n")):
            assert self.process.poll() is None, f"exited {self.process.returncode} first\n{self.stderr.read_text()}"
            assert time.monotonic() < deadline, f"no signal after {timeout}s\n{self.stderr.read_text()[-3000:]}"
            time.sleep(0.05)
        pid, at = self.log.read_text().split()
        return int(pid), float(at)

    def ended(self, since: float) -> tuple[int, float, list[int], str]:
        """(exit status, seconds from ``since`` to its exit, processes of its group left, stderr), waiting at most
        HANG_S (then TimeoutExpired: the caller's ``kill`` ends the run)."""
        status = self.process.wait(timeout=HANG_S)
        elapsed = time.time() - since
        return status, elapsed, alive_in_group(self.process.pid), self.stderr.read_text()

    def kill(self) -> None:
        if alive_in_group(self.process.pid):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture(scope="module")
def uninterrupted(demo, tmp_path_factory):
    """A function giving the run folder of the uninterrupted run with some overrides (each run once a module)."""
    runs: dict[tuple[str, ...], Path] = {}

    def run_dir(*overrides: str) -> Path:
        if overrides not in runs:
            out = tmp_path_factory.mktemp("uninterrupted")
            run_again(sft_command(demo, out, *overrides))
            runs[overrides] = out / "run"
        return runs[overrides]

    return run_dir


def assert_same_run(resumed: Path, uninterrupted: Path) -> None:
    losses, expected = train_losses(resumed), train_losses(uninterrupted)
    assert sorted(losses) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert losses[step] == pytest.approx(expected[step], abs=1e-6), step
    assert_same_weights(final_weights(resumed), final_weights(uninterrupted), atol=1e-6)


@pytest.mark.parametrize(
    "how, overrides", [("main", ()), ("group", LORA)], ids=["main-process-only", "process-group-lora"]
)
def test_sigterm_stops_every_rank_at_one_step_saves_it_and_the_same_command_resumes_exactly(
    demo, tmp_path, uninterrupted, how, overrides
):
    """Before: still running after 240 s (main process) or 100 s (group), or exit 143 with nothing saved."""
    args = sft_command(demo, tmp_path, *overrides)
    run = Run(args, f"{SIGNAL_STEP}@1@{how}", tmp_path)
    try:
        _, sent = run.fired()
        status, elapsed, left, stderr = run.ended(since=sent)
    finally:
        run.kill()
    assert status == EXIT[signal.SIGTERM], f"exit {status}\n{stderr[-3000:]}"
    assert elapsed < BOUND_S and not left, f"{elapsed:.0f}s after the signal, processes left: {left}"
    assert not (tmp_path / "run" / "final").exists(), "the run finished before the signal"
    saved = re.search(r"stopped by SIGTERM at step (\d+); its state is saved in (\S+)", stderr)
    assert saved, stderr[-3000:]
    step, checkpoint = int(saved.group(1)), Path(saved.group(2))
    assert SIGNAL_STEP < step < STEPS and checkpoint.name == f"step-{step:08d}.ckpt", saved.group(0)
    line = the_line(stderr, "lantern sft: interrupted by SIGTERM")
    assert line.endswith(": run the same command again to resume from it") and named_checkpoint(line) == checkpoint

    resumed = run_again(args)
    assert f"resuming from {checkpoint}" in resumed.stderr, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "run", uninterrupted(*overrides))


def test_a_rank_that_cannot_reach_the_step_does_not_hold_the_run(demo, tmp_path, uninterrupted):
    """Rank 1 stopped (SIGSTOP) after the first checkpoint, then SIGTERM to the main process, which by then waits
    for it in a collective: 143 at the deadline (STOP_GRACE_S), nothing saved, the last checkpoint named, rank 1
    killed; the same command resumes from that checkpoint. Before: waiting out the collective timeout (30 min)."""
    args = sft_command(demo, tmp_path)
    run = Run(args, f"{SIGNAL_STEP}@1@stop", tmp_path)
    try:
        rank_1, _ = run.fired()
        deadline = time.monotonic() + 30
        while state(rank_1) != "T":
            assert time.monotonic() < deadline, "rank 1 did not stop"
            time.sleep(0.05)
        time.sleep(1)  # rank 0 waits in its next collective by now (the outcome is the same if not)
        sent = time.time()
        os.kill(run.process.pid, signal.SIGTERM)
        status, elapsed, left, stderr = run.ended(since=sent)
    finally:
        run.kill()
    assert status == EXIT[signal.SIGTERM], f"exit {status}\n{stderr[-3000:]}"
    assert STOP_GRACE_S - 1 < elapsed < BOUND_S and not left, f"{elapsed:.0f}s after the signal, left: {left}"
    line = the_line(stderr, "ERROR trainer.parallel: SIGTERM: the ranks did not all reach an optimizer step")
    checkpoint = named_checkpoint(line)
    assert line.endswith("stopped without saving; the last checkpoint is " + str(checkpoint))
    assert checkpoint == tmp_path / "run" / "checkpoints" / f"step-{SIGNAL_STEP:08d}.ckpt"

    resumed = run_again(args)
    assert f"resuming from {checkpoint}" in resumed.stderr, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "run", uninterrupted())


def main() -> int:
    from alignment.commands.cli import main as lantern

    if SIGTERM_AT in os.environ:
        install(os.environ[SIGTERM_AT])
    return lantern(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
