"""kill -9, several times in one run, at seeded points in training and in checkpoint writing, single process
and 2-process FSDP2: resumed each time with ``checkpoint.resume=auto``, the run ends with the weights and the
loss history of an uninterrupted run. And a misconfigured W&B never stops a run: it goes on offline or
without W&B, with a one-line warning.

Every kill run is a real ``lantern pretrain`` process (``python -m tests.faults.killing``, which SIGKILLs the
run's process group at the point named by a ``KillPoint``); the plan of kill points comes from a seed, so a
failure names the plan and reproduces. The W&B cases run in-process, except online mode, which runs as a
process so that a hang is bounded by a timeout.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from alignment.stages.pretrain import run_pretrain
from tests.alignment.test_pretrain_run import (
    RUN_NAME,
    TINY,
    isolate_wandb,
    read_metrics,
    tiny_config,
)
from tests.faults.killing import (
    CHECKPOINT_PHASES,
    KILL_AT,
    KILL_LOG,
    TRAINING_PHASES,
    KillPoint,
    kill_plan,
)
from tests.helpers import run_command, run_lantern
from tests.trainer.test_distributed import (
    FSDP,
    assert_same_weights,
    command,
    environment,
    final_weights,
    train_losses,
)
from trainer.checkpoints import LATEST, checkpoint_problem

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 8, 2  # checkpoints at 2, 4, 6, 8: kill points in 4 saves and 8 steps
KILLS = 3
# The plans of these seeds, between them, kill in every phase (kill_plan(seed, KILLS, STEPS, EVERY)):
SINGLE_SEEDS = (
    1,
    3,
    4,
)  # 1: manifest@4, partial@6, after-update@7; 3: manifest, pointer, after-update; 4: renamed, written, before-update
FSDP_SEED = 1  # manifest@4 on rank 0, a shard folder half written on rank 1 at 6, after-update@7 on rank 1
RUN_TIMEOUT = 300


def killable_command(data_dir: Path, out_dir: Path, *overrides: str) -> list[str]:
    """test_distributed's ``lantern pretrain`` command, through the kill hooks, with a checkpoint every
    EVERY steps and the CSV logger."""
    base = command(
        data_dir,
        out_dir,
        f"trainer.max_steps={STEPS}",
        f"checkpoint.every_n_steps={EVERY}",
        "logger.kind=csv",
        "checkpoint.keep_last=2",
        *overrides,
    )
    assert base[1:3] == ["-m", "alignment.commands.cli"], base
    return [base[0], "-m", "tests.faults.killing", *base[3:]]


def start(
    data_dir: Path, out_dir: Path, overrides: tuple[str, ...], env: dict[str, str]
) -> subprocess.CompletedProcess:
    """One attempt, in its own process group (the kill takes the group: every rank, nothing else)."""
    return run_command(killable_command(data_dir, out_dir, *overrides), env=env, timeout=RUN_TIMEOUT)


def killed_and_resumed(data_dir: Path, out_dir: Path, plan: list[KillPoint], *overrides: str) -> Path:
    """Run, killed at each point of ``plan`` in turn and started again (resume=auto), then once to the end."""
    kill_log = out_dir / "kills.log"
    for attempt, point in enumerate(plan, 1):
        result = start(data_dir, out_dir, overrides, {**environment(), KILL_AT: str(point), KILL_LOG: str(kill_log)})
        where = f"attempt {attempt} of plan {[str(p) for p in plan]}"
        assert result.returncode == -signal.SIGKILL, (
            f"{where}: exit {result.returncode}, not killed\n{result.stderr[-4000:]}"
        )
        logged = kill_log.read_text().splitlines()
        assert len(logged) == attempt and logged[-1] == f"{point.phase} {point.step} {point.rank}", (
            f"{where}: kills logged {logged}"
        )
        assert not (out_dir / "run" / "final").exists(), f"{where}: the run finished before the kill"
    result = start(data_dir, out_dir, overrides, environment())
    assert result.returncode == 0, f"the run after plan {[str(p) for p in plan]} failed\n{result.stderr[-5000:]}"
    return out_dir / "run"


def assert_same_run(resumed: Path, uninterrupted: Path, plan: list[KillPoint]) -> None:
    """Same weights (1e-6) and the same loss for every step, each step in the history once; the checkpoint
    folder clean: the last save published, every checkpoint matching its manifest, no temporaries."""
    where = f"after kills at {[str(p) for p in plan]}"
    assert_same_weights(final_weights(resumed), final_weights(uninterrupted), atol=1e-6)
    expected, losses = train_losses(uninterrupted), train_losses(resumed)
    assert sorted(expected) == list(range(1, STEPS + 1))
    steps = [step for step, _ in read_metrics(resumed)["train/loss"]]
    assert steps == list(range(1, STEPS + 1)), f"{where}: train/loss history has steps {steps}"
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, abs=1e-6), f"{where}: step {step}"
    checkpoints = resumed / "checkpoints"
    assert (checkpoints / LATEST).read_text().strip() == f"step-{STEPS:08d}.ckpt", where
    assert not list(checkpoints.glob(".tmp-*")), where
    for checkpoint in checkpoints.glob("step-*.ckpt"):
        assert checkpoint_problem(checkpoint) is None, f"{where}: {checkpoint}: {checkpoint_problem(checkpoint)}"


# --------------------------------------------------------------------------------------------------
# the kill plans


def test_kill_plans_are_seeded_and_reach_every_phase():
    """A seed names its plan (failures reproduce); the seeds the tests use cover every phase, and each plan's
    kills are at increasing steps, so each is reached again after the previous kill's resume."""
    assert kill_plan(1, KILLS, STEPS, EVERY) == kill_plan(1, KILLS, STEPS, EVERY)
    phases = set()
    for seed in SINGLE_SEEDS:
        plan = kill_plan(seed, KILLS, STEPS, EVERY)
        assert [p.step for p in plan] == sorted({p.step for p in plan}), plan
        assert all(p.phase.startswith("ckpt-") for p in plan[:-1]) and not plan[-1].phase.startswith("ckpt-")
        phases |= {p.phase for p in plan}
    assert phases == set(TRAINING_PHASES + CHECKPOINT_PHASES)
    assert KillPoint.parse("ckpt-partial@6@1") == KillPoint("ckpt-partial", 6, 1)
    with pytest.raises(ValueError, match=KILL_AT):
        KillPoint.parse("ckpt-halfway@6")


# --------------------------------------------------------------------------------------------------
# single process


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = start(data_dir, out, (), environment())
    assert result.returncode == 0, result.stderr[-5000:]
    return out / "run"


@pytest.mark.parametrize(
    "seed", [SINGLE_SEEDS[0], *(pytest.param(s, marks=pytest.mark.slow) for s in SINGLE_SEEDS[1:])]
)
def test_killed_three_times_ends_as_uninterrupted(data_dir, tmp_path, uninterrupted, seed):
    plan = kill_plan(seed, KILLS, STEPS, EVERY)
    resumed = killed_and_resumed(data_dir, tmp_path, plan)
    assert_same_run(resumed, uninterrupted, plan)


# --------------------------------------------------------------------------------------------------
# 2-process FSDP2 (gloo on CPU)


@pytest.mark.slow
def test_fsdp_killed_three_times_ends_as_uninterrupted(data_dir, tmp_path):
    plan = kill_plan(FSDP_SEED, KILLS, STEPS, EVERY, ranks=2)
    assert any(p.rank == 1 for p in plan), plan
    uninterrupted = tmp_path / "uninterrupted"
    result = start(data_dir, uninterrupted, FSDP, environment())
    assert result.returncode == 0, result.stderr[-5000:]
    resumed = killed_and_resumed(data_dir, tmp_path / "killed", plan, *FSDP)
    assert (resumed / "checkpoints" / f"step-{STEPS:08d}.ckpt").is_dir(), "not a sharded FSDP checkpoint"
    assert_same_run(resumed, uninterrupted / "run", plan)


# --------------------------------------------------------------------------------------------------
# W&B misconfigured: the run goes on, offline or without W&B, with a one-line warning


GARBAGE_KEY = "not-a-key-" * 5  # 50 characters: well-formed enough for W&B to try the server with it
TWO_STEPS = ("logger.kind=wandb", "trainer.max_steps=2", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=2")


def lantern_warnings(caught: list[warnings.WarningMessage], records: list) -> list[str]:
    """What Lantern itself said: warnings raised from its packages and its loggers' warnings."""
    said = [
        str(w.message)
        for w in caught
        if Path(w.filename).resolve().is_relative_to(ROOT) and "/tests/" not in w.filename
    ]
    return said + [
        r.getMessage()
        for r in records
        if r.levelname == "WARNING" and r.name.split(".")[0] in ("trainer", "models", "data")
    ]


def assert_run_went_on(run_dir: Path, said: list[str]) -> None:
    """Trained to the end (final model, both steps in metrics.csv) with its metrics somewhere (an offline W&B
    run, or the CSV logger Lantern falls back to), and one one-line warning about W&B."""
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert [step for step, _ in read_metrics(run_dir)["train/loss"]] == [1, 2]
    offline, csv = list((run_dir / "wandb").glob("offline-run-*")), run_dir / "csv" / "metrics.csv"
    assert offline or csv.is_file(), f"metrics went nowhere: neither an offline W&B run nor {csv}"
    about_wandb = [message for message in said if "W&B" in message or "wandb" in message.lower()]
    assert about_wandb, f"no warning about W&B; Lantern said {said}"
    for message in about_wandb:
        assert "\n" not in message.strip(), f"a W&B warning of several lines: {message!r}"


@pytest.mark.parametrize(
    "env, overrides",
    [
        ({"WANDB_MODE": "bogus"}, ()),
        ({}, ("logger.project=bad/name#?%:x", "logger.mode=offline")),
        ({"WANDB_API_KEY": GARBAGE_KEY}, ()),  # logger.mode=auto: the server is unreachable here
        ({"WANDB_API_KEY": "garbage"}, ()),
        (None, ()),  # None: `import wandb` fails
    ],
    ids=["bad-WANDB_MODE", "bad-project-name", "garbage-key-auto", "short-garbage-key-auto", "wandb-import-error"],
)
def test_wandb_misconfigured_run_goes_on(data_dir, tmp_path, monkeypatch, caplog, env, overrides):
    isolate_wandb(monkeypatch, tmp_path)
    if env is None:
        monkeypatch.setitem(sys.modules, "wandb", None)
    for variable, value in (env or {}).items():
        monkeypatch.setenv(variable, value)
    config = tiny_config(data_dir, tmp_path / "runs", *TWO_STEPS, *overrides)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        run_dir = run_pretrain(config)
    assert run_dir == tmp_path / "runs" / RUN_NAME
    assert_run_went_on(run_dir, lantern_warnings(caught, caplog.records))


ONLINE_BOUND_S = 60  # the run itself takes ~12 s here; W&B's own init timeout and retries are ~2 minutes


@pytest.mark.slow  # a process of its own, and up to ONLINE_BOUND_S when W&B does wait
def test_wandb_online_without_network_is_bounded(data_dir, tmp_path):
    """logger.mode=online with a garbage API key and no network (none exists where the tests run): the run
    must not wait on W&B's retries; it goes on, offline or without W&B, with a one-line warning."""
    env = {k: v for k, v in environment().items() if not k.startswith("WANDB_")}
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        (tmp_path / variable).mkdir()
        env[variable] = str(tmp_path / variable)
    env["WANDB_API_KEY"] = GARBAGE_KEY
    args = [
        sys.executable,
        "-m",
        "alignment.commands.cli",
        "pretrain",
        str(TINY),
        f"data.out_dir={data_dir}",
        f"run.out_dir={tmp_path}",
        "logger.mode=online",
        *TWO_STEPS,
    ]
    process = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    started = time.monotonic()
    try:
        output, _ = process.communicate(timeout=ONLINE_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its W&B service processes too
        output, _ = process.communicate()
        pytest.fail(
            f"logger.mode=online without network: the run was still going after {ONLINE_BOUND_S} s\n{output[-3000:]}"
        )
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, (
        f"exit {process.returncode} after {time.monotonic() - started:.0f} s\n{output[-4000:]}"
    )
    said = [
        line for line in output.splitlines() if ("W&B" in line or "wandb" in line.lower()) and "warn" in line.lower()
    ]
    assert_run_went_on(tmp_path / RUN_NAME, said)


@pytest.mark.slow
def test_real_model_grpo_killed_mid_run_resumes_to_the_uninterrupted_adapters(smollm2, tmp_path):
    """GRPO with LoRA on SmolLM2-135M-Instruct (configs/grpo/smollm2.yaml, cut to a few short rollouts) killed -9
    after the update of rollout 2, before its checkpoint, and resumed from rollout 1's: the same final weights and
    the same rollout scores as a run never killed (sampled responses, sampler state and adapters all resumed)."""
    from data.demo.arithmetic import write_arithmetic_dataset

    data = write_arithmetic_dataset(tmp_path / "data", tasks=["add", "multiply"], n_train=16, n_val=4, n_pairs=2)
    overrides = [
        f"init.policy={smollm2.folder}", f"data.train=[{data['train_prompts']}]", f"data.val=[{data['prompts']}]",
        "run.name=run", "trainer.max_steps=3", "checkpoint.every_n_steps=1", "grpo.prompts_per_rollout=2",
        "grpo.group_size=2", "grpo.minibatch_size=4", "grpo.micro_batch_size=4", "grpo.response_max_tokens=6",
        "eval.every_n_rollouts=100", "eval.generations=2", "logger.kind=csv",
    ]  # fmt: skip

    def grpo(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
        args = ["grpo", str(ROOT / "configs/grpo/smollm2.yaml"), f"run.out_dir={out}", *overrides]
        return run_lantern(*args, module="tests.faults.killing", env=env, timeout=RUN_TIMEOUT)

    straight = grpo(tmp_path / "straight", environment())
    assert straight.returncode == 0, straight.stderr[-4000:]
    point, log = KillPoint("after-update", 2), tmp_path / "kills.log"
    killed = grpo(tmp_path / "killed", {**environment(), KILL_AT: str(point), KILL_LOG: str(log)})
    assert killed.returncode == -signal.SIGKILL and log.read_text() == "after-update 2 0\n", killed.stderr[-4000:]
    assert not (tmp_path / "killed" / "run" / "final").exists()
    resumed = grpo(tmp_path / "killed", environment())
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_weights(
        final_weights(tmp_path / "killed" / "run"), final_weights(tmp_path / "straight" / "run"), atol=1e-6
    )
    scores = {}
    for run in ("straight", "killed"):  # reward.csv: metric, step, value; each rollout once, the replayed one too
        with open(tmp_path / run / "run" / "reward.csv", newline="") as handle:
            scores[run] = [row for row in csv.DictReader(handle) if row["metric"] == "grpo/score"]
    assert len(scores["killed"]) == 3 and scores["killed"] == scores["straight"]
