"""A run stopped by a signal, a config file with nothing in it, and a W&B mode nobody knows: each says what it does
and does what it says.

- SIGTERM (a scheduler stopping a job) and SIGINT (Ctrl-C) end ``lantern pretrain`` and ``lantern pipeline`` with
  exit status 128 + the signal (143, 130), never 0 (Lightning's exit after SIGTERM) nor 1 (after Ctrl-C), and one
  line on stderr naming the last checkpoint (the pipeline: the stage) and the command that resumes; that command
  does resume. Real ``python -m alignment.commands.cli`` processes in their own session, signalled once training is under
  way; the paths outside training (a signal before ``trainer.fit``, between pipeline stages) run in-process.
- An empty config file (0 bytes, blank lines, only comments) is refused in one line naming it, by every stage and
  the pipeline, instead of starting a run on the defaults.
- ``WANDB_MODE=bogus`` is ignored with a warning and the run really logs to an offline W&B run, not to CSV.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from alignment.commands.cli import main as lantern
from alignment.commands.pipeline import PipelineConfig, run_pipeline
from alignment.stages import registry
from alignment.stages.pretrain import run_pretrain
from models.errors import ConfigError
from tests.alignment.test_pretrain_run import RUN_NAME, isolate_wandb, read_metrics, tiny_config, wandb_history
from tests.faults.test_kill import TWO_STEPS, lantern_warnings
from tests.helpers import run_command
from tests.trainer.test_distributed import command, environment, wait_for_checkpoint
from trainer import interrupts
from trainer.checkpoints import LATEST, checkpoint_problem, checkpoint_step
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40  # the signal comes at the first checkpoint (step 2): ~40 steps' time for it to land before the end
EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}
RUN_TIMEOUT = 300


def interrupted(
    args: list[str], checkpoints: Path, how: signal.Signals, tmp_path: Path, sigint=signal.SIG_DFL
) -> tuple[int, str]:
    """Start ``args`` in its own session with SIGINT's disposition ``sigint`` (the default: as from a terminal,
    whatever pytest inherited: a suite started by ``nohup`` or ``&`` ignores it), send ``how`` to its process group
    (as a scheduler or a terminal's Ctrl-C does) once ``checkpoints`` holds its first checkpoint; (exit status,
    stderr)."""
    stdout, stderr = tmp_path / "interrupted.out", tmp_path / "interrupted.err"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        process = subprocess.Popen(
            args, cwd=ROOT, env=environment(), stdout=out, stderr=err, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
        )  # fmt: skip
        try:
            wait_for_checkpoint(process, checkpoints, 2, timeout=RUN_TIMEOUT)
            os.killpg(process.pid, how)
            process.wait(timeout=RUN_TIMEOUT)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return process.returncode, stderr.read_text()


def run_again(args: list[str]) -> subprocess.CompletedProcess:
    result = run_command(args, env=environment(), timeout=RUN_TIMEOUT)
    assert result.returncode == 0, result.stderr[-5000:]
    return result


def the_line(stderr: str, prefix: str) -> str:
    """The one stderr line starting with ``prefix``."""
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one line starting {prefix!r}, got {lines}\n{stderr[-3000:]}"
    return lines[0]


def named_checkpoint(line: str) -> Path:
    """The checkpoint the interrupted line names: the one ``latest`` points at, complete and verified."""
    match = re.search(r"the last checkpoint is (\S+\.ckpt)", line)
    assert match, line
    checkpoint = Path(match.group(1))
    assert (checkpoint.parent / LATEST).read_text().strip() == checkpoint.name
    assert checkpoint_problem(checkpoint) is None, checkpoint_problem(checkpoint)
    return checkpoint


def assert_whole_history(run_dir: Path) -> None:
    steps = [step for step, _ in read_metrics(run_dir)["train/loss"]]
    assert steps == list(range(1, STEPS + 1)), f"train/loss history after the resume: steps {steps}"
    assert (run_dir / "final" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------------
# SIGTERM and Ctrl-C: the exit status, one line, and the same command resumes


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_an_interrupted_run_exits_128_plus_the_signal_and_the_same_command_resumes(data_dir, tmp_path, how):
    """Before: SIGTERM exited 0 and Ctrl-C 1, without a word of Lantern's."""
    args = command(data_dir, tmp_path, f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=2")
    run_dir = tmp_path / "run"
    status, stderr = interrupted(args, run_dir / "checkpoints", how, tmp_path)
    assert status == EXIT[how], f"exit {status} after {how.name}\n{stderr[-3000:]}"
    assert not (run_dir / "final").exists(), "the run finished before the signal"
    line = the_line(stderr, f"lantern pretrain: interrupted by {how.name}")
    assert line.endswith(": run the same command again to resume from it"), line
    checkpoint = named_checkpoint(line)
    assert checkpoint.parent == run_dir / "checkpoints"
    if how == signal.SIGTERM:  # a preemption loses no step: the state of the step it stopped after is saved
        saved = re.search(r"stopped by SIGTERM at step (\d+); its state is saved in (\S+)", stderr)
        assert saved, stderr[-3000:]
        assert Path(saved.group(2)) == checkpoint and checkpoint_step(checkpoint) == int(saved.group(1))

    resumed = run_again(args)
    assert f"resuming from {checkpoint}" in resumed.stderr, resumed.stderr[-3000:]
    assert_whole_history(run_dir)


def test_a_run_started_ignoring_sigint_keeps_ignoring_it_says_so_and_stops_on_sigterm(data_dir, tmp_path):
    """`nohup lantern pretrain ... &` (or `&` in a script) starts Lantern with SIGINT ignored: as POSIX programs do,
    it keeps the disposition it was given (a Ctrl-C meant for the shell's foreground job spares it), says so at
    the start with what stops it, and SIGTERM still stops it with a checkpoint. Before: the suite's SIGINT test
    failed when pytest itself was started ignoring SIGINT (the child inherited it), with nothing said."""
    # steps enough that the run is still going a second after the signal (it stops at SIGTERM)
    args = command(data_dir, tmp_path, f"trainer.max_steps={50 * STEPS}", "checkpoint.every_n_steps=2")
    run_dir = tmp_path / "run"
    stdout, stderr = tmp_path / "ignored.out", tmp_path / "ignored.err"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        process = subprocess.Popen(
            args, cwd=ROOT, env=environment(), stdout=out, stderr=err, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )  # fmt: skip
        try:
            wait_for_checkpoint(process, run_dir / "checkpoints", 2, timeout=RUN_TIMEOUT)
            os.killpg(process.pid, signal.SIGINT)
            time.sleep(1.0)  # time for a SIGINT that was not ignored to stop the run (a step takes milliseconds)
            ignored = process.poll() is None
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=RUN_TIMEOUT)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    text = stderr.read_text()
    said = the_line(text, "INFO lantern: SIGINT (Ctrl-C, kill -INT) is ignored")
    assert f"stop it with SIGTERM (kill {process.pid})" in said, said
    assert ignored, f"the run stopped on the ignored SIGINT (exit {process.returncode})\n{text[-3000:]}"
    assert process.returncode == 143, f"exit {process.returncode}\n{text[-3000:]}"
    assert "interrupted by SIGINT" not in text
    the_line(text, "lantern pretrain: interrupted by SIGTERM")


def test_an_interrupted_pipeline_names_the_stage_and_its_command_resumes_it(tmp_path):
    """Before: the pipeline stopped mid-stage without a word and exited 0 (SIGTERM) or 1 (Ctrl-C). SIGINT takes the
    same path (main's handler); the run-level test above sends both."""
    how = signal.SIGTERM
    out = tmp_path / "pipeline"
    overrides = [
        f"out_dir={out}", "stages=[prepare,pretrain]", f"pretrain.trainer.max_steps={STEPS}",
        "pretrain.checkpoint.every_n_steps=2", "pretrain.trainer.val_every_n_steps=1000",
        "pretrain.trainer.accelerator=cpu",
    ]  # fmt: skip
    args = [sys.executable, "-m", "alignment.commands.cli", "pipeline", "configs/pipeline/tiny.yaml", *overrides]
    status, stderr = interrupted(args, out / "pretrain" / "checkpoints", how, tmp_path)
    assert status == EXIT[how], f"exit {status} after {how.name}\n{stderr[-3000:]}"
    assert not (out / "pretrain" / "final").exists(), "the stage finished before the signal"
    line = the_line(stderr, f"lantern pipeline: interrupted by {how.name}; stage 2/2 (pretrain) stopped, ")
    resume = shlex.join(["lantern", *args[3:]])  # the command as typed: 'stages=[...]' quoted for the shell
    assert line.endswith(f"run the same command again to resume it (finished stages are skipped): {resume}"), line
    checkpoint = named_checkpoint(line)
    assert checkpoint.parent == out / "pretrain" / "checkpoints"

    resumed = run_again(args)
    assert f"resuming from {checkpoint}" in resumed.stderr, resumed.stderr[-3000:]
    assert re.search(r"lantern.pipeline: pretrain: resumed in ", resumed.stderr), resumed.stderr[-3000:]
    assert_whole_history(out / "pretrain")


class Unhandled(Exception):
    pass


def unhandled(signum: int, frame) -> None:
    raise Unhandled(f"{signal.Signals(signum).name} reached the test's own handler: the command did not handle it")


@pytest.fixture
def sigterm_guard():
    """These tests signal the pytest process itself: a SIGTERM nobody handles fails the test instead of killing
    the session."""
    previous = signal.signal(signal.SIGTERM, unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_outside_training_exits_143_with_the_line(tmp_path, monkeypatch, capsys, sigterm_guard):
    """Before trainer.fit (loading data, checking the config) Lightning's handler is not there: SIGTERM stops the
    command where it is (before: a test's handler, or the default action, death without a word), exit 143; the line
    says no checkpoint exists yet."""

    def terminated_while_loading(config, stage):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises inside the sleep
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr("alignment.stages.pretrain.run_pretrain", terminated_while_loading)
    status = lantern(["pretrain", str(ROOT / "configs/pretrain/tiny.yaml"), f"run.out_dir={tmp_path}"])
    assert status == 143
    line = the_line(capsys.readouterr().err, "lantern pretrain: interrupted by SIGTERM; ")
    assert line.endswith(f"no checkpoint in {tmp_path / RUN_NAME / 'checkpoints'} yet: running the same command "
                         "again starts it over"), line  # fmt: skip
    assert signal.getsignal(signal.SIGTERM) is unhandled  # the handler the caller had is back
    assert interrupts.received_signal() is None


def test_a_sigterm_a_stage_finished_through_starts_no_further_stage(tmp_path, monkeypatch, capsys, sigterm_guard):
    """Lightning's handler only stops a loop with steps left: a SIGTERM in the last step lets the stage finish.
    The next stage must not start then: the pipeline exits 143 naming it."""
    ran = []

    def model_stage(self, stage: str) -> None:
        ran.append(stage)
        ours = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda signum, frame: ours(signum, frame))  # as Lightning composes its own
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # delivered and recorded: no exception (Lightning's loop would stop itself)
        signal.signal(signal.SIGTERM, ours)  # trainer.fit ends: Lightning restores the handler it found
        self.status[stage] = "ran"

    monkeypatch.chdir(ROOT)  # the pipeline's presets name repository files
    monkeypatch.setattr("alignment.commands.pipeline.Pipeline.write_demo", lambda self: None)
    monkeypatch.setattr("alignment.commands.pipeline.Pipeline.model_stage", model_stage)
    args = ["pipeline", "configs/pipeline/tiny.yaml", f"out_dir={tmp_path}", "stages=[pretrain,sft]"]
    assert lantern(args) == 143 and ran == ["pretrain"]
    line = the_line(capsys.readouterr().err, "lantern pipeline: interrupted by SIGTERM; ")
    assert f"; stage 2/2 (sft) stopped, no checkpoint in {tmp_path / 'sft' / 'checkpoints'} yet; " in line, line
    resume = shlex.join(["lantern", *args])
    assert line.endswith(f"run the same command again to resume it (finished stages are skipped): {resume}"), line


# --------------------------------------------------------------------------------------------------
# an empty config file


COMMANDS = ["prepare", "pretrain", "sft", "rm", "ppo", "grpo", "dpo", "rejection-sampling", "pipeline"]


@pytest.mark.parametrize(
    "text", ["", "\n   \n\n", "# nothing set yet\n\n# model: tiny\n"], ids=["0-bytes", "blank", "comments"]
)
def test_an_empty_config_file_is_refused_naming_it(tmp_path, monkeypatch, capsys, text):
    """Before: an empty file read as {} and started a full run on every default."""
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    monkeypatch.chdir(tmp_path)  # anything a run would create lands here
    for schema in [PipelineConfig, *(stage.schema for stage in registry.STAGES)]:
        with pytest.raises(ConfigError, match=f"config file {re.escape(str(empty))} is empty"):
            load_config(schema, empty, [])
    for name in COMMANDS:
        assert lantern([name, str(empty)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err == f"lantern {name}: error: config file {empty} is empty (no settings, only blank lines or " \
            "comments): refusing to run on the defaults alone; give a config with settings (e.g. a preset under " \
            "configs/)", err  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.yaml"]  # nothing started


def test_a_pipeline_naming_an_empty_stage_config_is_refused_naming_that_file(tmp_path, monkeypatch):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# to be written\n")
    monkeypatch.chdir(ROOT)  # the pipeline's presets name repository files
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(empty))} is empty"):
        run_pipeline("configs/pipeline/tiny.yaml", [f"out_dir={tmp_path / 'out'}", f"pretrain.config={empty}"])
    assert not (tmp_path / "out" / "pretrain").exists() and not (tmp_path / "out" / "data" / "corpus").exists()


# --------------------------------------------------------------------------------------------------
# WANDB_MODE=bogus: ignored with a warning, and the run really logs offline to W&B


@pytest.mark.parametrize("mode", ["auto", "offline"])
def test_a_bad_wandb_mode_is_ignored_and_the_run_logs_offline_to_wandb(data_dir, tmp_path, monkeypatch, caplog, mode):
    """Before: "logging offline" was said, then W&B refused WANDB_MODE=bogus itself and the run logged to CSV."""
    isolate_wandb(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "bogus")
    config = tiny_config(data_dir, tmp_path / "runs", *TWO_STEPS, f"logger.mode={mode}")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        run_dir = run_pretrain(config)
    said = lantern_warnings(caught, caplog.records)
    about_wandb = [message for message in said if "W&B" in message or "WANDB" in message]
    assert about_wandb == ["WANDB_MODE='bogus' is not one of online, offline, disabled: ignored; logging offline"]
    assert not (run_dir / "csv").exists(), "the run fell back to the CSV logger"
    assert os.environ["WANDB_MODE"] == "bogus"  # hidden from W&B while it started, the user's environment kept

    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, f"no offline W&B run in {run_dir / 'wandb'}: {offline}"
    logs = list(offline[0].glob("run-*.wandb"))
    assert len(logs) == 1, logs
    deadline = time.monotonic() + 60  # W&B's service writes the last records a moment after finish() (see
    while time.monotonic() < deadline:  # test_pretrain_run.test_wandb_offline_run_holds_the_logged_metrics)
        try:
            if "exit" in wandb_history(logs[0])[1]:
                break
        except AssertionError:
            pass
        time.sleep(0.5)
    rows, kinds = wandb_history(logs[0])
    assert "exit" in kinds, "the offline W&B run was not finished"
    assert len([row for row in rows if "train/loss" in row]) == 2, rows
