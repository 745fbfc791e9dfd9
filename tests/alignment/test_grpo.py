"""GRPO / RLOO as a stage (alignment/stages/grpo.py): a toy verifiable reward rises, the first ratio is
exactly 1, resume is exact, bad configs and overlapping held-out prompts fail before compute, and 2-process
FSDP2 on CPU matches a single process. The advantage maths by hand is in test_losses.py."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from alignment.schemas.rl import GRPOConfig
from alignment.stages.grpo import run_grpo
from models.errors import ConfigError, DataError
from tests.alignment.compiled_decode import run_checked
from tests.helpers import run_cli
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
VOWELS = "aeiou"


def vowel_rich(record: dict, answer: str) -> float:
    """Toy verifiable reward, pass or fail like a real checker: 1 when at least 40% of the answer's letters are
    vowels (about 4 in 10 of a random policy's samples, so most groups carry signal)."""
    letters = [c for c in answer.lower() if c.isalpha()]
    return float(bool(letters) and sum(c in VOWELS for c in letters) / len(letters) >= 0.4)


def grpo_config(setup, out_dir, *overrides: str) -> GRPOConfig:
    return load_config(
        GRPOConfig,
        ROOT / "configs/grpo/tiny.yaml",
        [
            f"init.policy={setup['policy']}",
            f"data.train=[{setup['train_prompts']}]",
            f"data.val=[{setup['prompts']}]",
            f"run.out_dir={out_dir}",
            "logger.kind=none",
            *overrides,
        ],
    )


def series(run_dir: Path, name: str = "reward.csv") -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    with open(run_dir / name, newline="") as handle:
        for row in csv.DictReader(handle):
            found.setdefault(row["metric"], []).append(float(row["value"]))
    return found


TOY = "reward.terms=[{kind: checker, path: 'tests.alignment.test_grpo:vowel_rich'}]"


@pytest.mark.parametrize(("baseline", "aggregation"), [("grpo", "token"), ("rloo", "token"), ("grpo", "sequence")])
def test_a_verifiable_toy_reward_rises(setup, tmp_path, baseline, aggregation):
    config = grpo_config(
        setup, tmp_path, TOY, f"grpo.baseline={baseline}", f"grpo.loss_aggregation={aggregation}",
        "trainer.max_steps=8", "grpo.prompts_per_rollout=4",
        "grpo.group_size=8", "grpo.minibatch_size=16", "grpo.micro_batch_size=16", "optim.lr=3e-3",
        "grpo.kl_coef=0.0", "checkpoint.every_n_steps=100", "eval.every_n_rollouts=100", "eval.pass_k=0",
    )  # fmt: skip
    run_dir = run_grpo(config)
    scores = series(run_dir)["grpo/score"]
    assert len(scores) == 8
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.15, scores
    heldout = (run_dir / "heldout.json").read_text()
    assert '"before"' in heldout and '"after"' in heldout and '"se"' in heldout


@contextmanager
def first_log_ratios() -> Iterator[list[float]]:
    """The first minibatch's max |log ratio| of every GRPO rollout run inside (0 when the training pass reproduces
    the rollout's log-probs), in order."""
    from alignment.stages.grpo import GRPOModule

    captured: list[float] = []
    update = GRPOModule.update

    def spy(self, *args):
        stats = update(self, *args)
        captured.append(stats["first_minibatch_max_log_ratio"])
        return stats

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GRPOModule, "update", spy)
        yield captured


def test_first_ratio_is_exactly_one(setup, tmp_path):
    """The training pass's first minibatch reproduces the rollout's old log-probs bit for bit."""
    config = grpo_config(setup, tmp_path, "trainer.max_steps=2", "eval.every_n_rollouts=100", "eval.pass_k=0")
    with first_log_ratios() as captured:
        run_grpo(config)
    assert captured == [0.0, 0.0]


def test_one_update_a_rollout_takes_the_sampling_log_probs_from_its_own_forward(setup, tmp_path, monkeypatch):
    """A rollout of 16 with minibatch 16 makes one update: its forward gives the old log-probs (one policy pass a
    micro-batch fewer), and it trains the weights the separate pass trains."""
    from alignment.stages.grpo import GRPOModule

    calls: list[str] = []
    forward = GRPOModule.policy_logprobs

    def counted(self, model, *args):
        if model is self.model:  # not the frozen reference's passes
            calls.append("grad" if torch.is_grad_enabled() else "no_grad")
        return forward(self, model, *args)

    monkeypatch.setattr(GRPOModule, "policy_logprobs", counted)
    common = ["trainer.max_steps=2", "grpo.minibatch_size=16", "grpo.micro_batch_size=8", "eval.every_n_rollouts=100",
              "eval.pass_k=0", "optim.lr=3e-3", TOY]  # fmt: skip
    one_pass = run_grpo(grpo_config(setup, tmp_path / "one", *common))
    assert calls.count("no_grad") == 0 and calls.count("grad") == 4  # 2 rollouts x 2 micro-batches
    calls.clear()
    monkeypatch.setattr(GRPOModule, "one_update", lambda self, rollout: False)
    two_passes = run_grpo(grpo_config(setup, tmp_path / "two", *common))
    assert calls.count("no_grad") == 4 and calls.count("grad") == 4
    a, b = load_file(one_pass / "final/model.safetensors"), load_file(two_passes / "final/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)


class Crash(Exception):
    pass


class CrashAfterTwo(L.Callback):
    """Stops a run after its second rollout (its step-2 checkpoint written), as a crash would."""

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2:
            raise Crash


def test_resume_is_exact(setup, tmp_path):
    """4 rollouts straight vs 2, a crash, and a resume for the last 2: the same policy (sampler state resumed)."""
    common = ["trainer.max_steps=4", "checkpoint.every_n_steps=2", "eval.every_n_rollouts=100", "eval.pass_k=0"]
    straight = run_grpo(grpo_config(setup, tmp_path / "straight", *common))

    with pytest.raises(Crash):
        run_grpo(grpo_config(setup, tmp_path / "resumed", *common), extra_callbacks=[CrashAfterTwo()])
    checkpoint = torch.load(tmp_path / "resumed/grpo-tiny/checkpoints/step-00000002.ckpt", weights_only=True)
    assert checkpoint["rl"]["sampler"].dtype == torch.uint8 and "before" in checkpoint["rl"]["heldout"]
    resumed = run_grpo(grpo_config(setup, tmp_path / "resumed", *common))
    a, b = load_file(straight / "final/model.safetensors"), load_file(resumed / "final/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("grpo.group_size=1", "grpo.group_size must be > 1"),
        ("grpo.minibatch_size=5", "must be a multiple of grpo.minibatch_size"),
        ("init.policy=null", "init.policy is required"),
        ("reward.terms=[]", "reward.terms is empty"),
        ("reward.terms=[{kind: checker, path: 'no.such:f'}]", "reward.terms[0].path: cannot import"),
        ("reward.terms=[{kind: reward_model, path: ''}]", "reward.terms[0].path: a reward_model term needs"),
        ("trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches must be 1"),
    ],
)
def test_bad_configs_fail_before_compute(setup, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_grpo(grpo_config(setup, tmp_path, override))
    assert not (tmp_path / "grpo-tiny").exists()  # nothing was started


def test_held_out_prompts_that_overlap_training_prompts_are_refused(setup, tmp_path):
    config = grpo_config(setup, tmp_path, f"data.val=[{setup['train_prompts']}]")
    with pytest.raises(DataError, match="held-out prompts also appear in the training prompts"):
        run_grpo(config)
    assert not (tmp_path / "grpo-tiny").exists()


@pytest.mark.slow
def test_fsdp_grpo_on_two_processes(setup, tmp_path):
    """2-process FSDP2 GRPO on CPU over tool episodes: whole groups per rank, losses reduced over ranks; with greedy
    sampling its first rollout's score equals a single process's over the same prompts, and both evaluate the same
    held-out prompts, and the first rollout's episodes have as many turns. (Single-turn GRPO under FSDP2: the compiled
    test below. In a child process no test sampler ends the tiny policy's turns: most end at a turn's token limit.)"""
    common = [
        f"init.policy={setup['policy']}", f"data.train=[{setup['train_prompts']}]", f"data.val=[{setup['prompts']}]",
        "logger.kind=csv", "trainer.max_steps=2", "eval.every_n_rollouts=2", "trainer.accelerator=cpu",
        "run.name=run", "grpo.temperature=0", "eval.pass_k=2", "eval.pass_k_prompts=4", *EPISODES,
    ]  # fmt: skip
    runs = {
        "single": ["grpo.prompts_per_rollout=4", "grpo.minibatch_size=8"],
        "fsdp": ["trainer.strategy=fsdp", "trainer.devices=2", "grpo.prompts_per_rollout=2", "grpo.minibatch_size=4"],
    }
    results = {}
    for name, extra in runs.items():
        run_cli("grpo", str(ROOT / "configs/grpo/tiny.yaml"), f"run.out_dir={tmp_path / name}", *common, *extra)
        run_dir = tmp_path / name / "run"
        assert (run_dir / "final" / "model.safetensors").is_file() and (run_dir / "heldout.json").is_file()
        with open(run_dir / "csv/metrics.csv", newline="") as handle:
            turns = [float(row["grpo/turns"]) for row in csv.DictReader(handle) if row.get("grpo/turns")]
        assert len(turns) == 2 and min(turns) >= 1  # rollouts of episodes
        score, held_out = series(run_dir)["grpo/score"][0], series(run_dir, "eval.csv")["eval/gt_score"][0]
        results[name] = score, held_out, turns[0]
    assert results["fsdp"] == pytest.approx(results["single"], abs=1e-5)


def test_sampler_state_is_restored_whichever_comes_first_the_sampler_or_the_checkpoint(setup, tmp_path):
    """Single-process runs restore the checkpoint before on_fit_start creates the sampler; FSDP
    (ModelParallelStrategy) restores it after. Both orders must continue the saved random stream."""
    from alignment.shared.rewards import build_reward
    from alignment.stages.grpo import GRPOModule
    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.checkpoint import load_checkpoint

    config = grpo_config(setup, tmp_path)
    policy = load_checkpoint(setup["policy"])
    saved = torch.Generator().manual_seed(99)
    torch.rand(7, generator=saved)  # somewhere in the middle of its stream
    checkpoint = {"rl": {"eval_history": {}, "heldout": {}, "sampler": saved.get_state(), "sampler_device": "cpu"}}
    expected = torch.randint(0, 1000, (5,), generator=torch.Generator().manual_seed(0).set_state(saved.get_state()))

    def module() -> GRPOModule:
        reward = build_reward(config.reward.terms)
        return GRPOModule(config, policy, policy, reward, Tokenizer.load("default"))

    before = module()  # single process: the checkpoint first, then the sampler
    before.on_load_checkpoint(checkpoint)
    before.sampler = torch.Generator().manual_seed(config.run.seed)
    before._apply_sampler_state()
    after = module()  # FSDP: the sampler first, then the checkpoint
    after.sampler = torch.Generator().manual_seed(config.run.seed)
    after.on_load_checkpoint(checkpoint)
    for restored in (before, after):
        assert torch.equal(torch.randint(0, 1000, (5,), generator=restored.sampler), expected)


@pytest.mark.slow
def test_fsdp_compiled_blocks_rollouts_decode_compiled_as_eager(setup, tmp_path):
    """Issue 22: GRPO under FSDP2 + torch.compile + activation checkpointing on 2 gloo processes, its sampled
    rollouts (temperature 1), greedy held-out answers and pass@k samples decoded by the compiled static decode step
    (the CPU's ``auto`` made compiled by tests/alignment/compiled_decode.py): every generate call on every rank gives
    the eager decode's tokens from the same generator state (the PPO test has the error this used to stop with)."""
    records = run_checked(
        "grpo", str(ROOT / "configs/grpo/tiny.yaml"), f"run.out_dir={tmp_path}", "run.name=run",
        f"init.policy={setup['policy']}", f"data.train=[{setup['train_prompts']}]", f"data.val=[{setup['prompts']}]",
        "logger.kind=none", "trainer.accelerator=cpu", "trainer.strategy=fsdp", "trainer.devices=2",
        "trainer.compile=true", "trainer.activation_checkpointing=full", "trainer.max_steps=2",
        "eval.every_n_rollouts=2", "eval.generations=4", "eval.pass_k=2", "eval.pass_k_prompts=4",
        "grpo.prompts_per_rollout=2", "grpo.minibatch_size=8", log=tmp_path / "decode.jsonl",
    )  # fmt: skip
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert {r["rank"] for r in records} == {0, 1} and all(r["compiled_steps"] > 0 for r in records)
    rollouts = [r for r in records if r["rows"] == 8 and r["temperature"] == 1.0]  # 2 prompts x a group of 4
    assert len(rollouts) == 4
    assert all(r["tokens_equal"] and r["mask_equal"] for r in records), records
    assert max(r["max_logprob_difference"] for r in records) < 1e-4


EPISODES = (
    "episodes.environment=tests.alignment.conftest:AskAgain",
    "episodes.max_turns=2",
    "episodes.max_tokens=256",
)


def test_multi_turn_episodes_train_and_resume_exactly_with_the_environments_rng(setup, tmp_path, turns_that_end):
    """GRPO over two-turn episodes: the turns and the ends are logged; a crash after 2 of 4 rollouts resumes (the
    sampler and the environment's RNG) to the uninterrupted run's weights."""
    common = [
        *EPISODES, "trainer.max_steps=4", "checkpoint.every_n_steps=2", "eval.every_n_rollouts=100", "eval.pass_k=0",
        "eval.generations=4", "logger.kind=csv",
    ]  # fmt: skip
    straight = run_grpo(grpo_config(setup, tmp_path / "straight", *common))
    with open(straight / "csv/metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("grpo/turns")]
    assert len(rows) == 4 and all(float(row["grpo/turns"]) == 2 for row in rows), rows
    assert all(float(row["grpo/ended_answer"]) == 1 for row in rows)  # every episode gave its second turn

    with pytest.raises(Crash):
        run_grpo(grpo_config(setup, tmp_path / "resumed", *common), extra_callbacks=[CrashAfterTwo()])
    checkpoint = torch.load(tmp_path / "resumed/grpo-tiny/checkpoints/step-00000002.ckpt", weights_only=True)
    assert "environment_rng" in checkpoint["rl"]
    resumed = run_grpo(grpo_config(setup, tmp_path / "resumed", *common))
    a, b = load_file(straight / "final/model.safetensors"), load_file(resumed / "final/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_an_environment_that_is_not_one_or_episodes_longer_than_the_context_are_refused_before_compute(setup, tmp_path):
    with pytest.raises(ConfigError, match="^episodes.environment: json:dumps is not an Environment"):
        run_grpo(grpo_config(setup, tmp_path, "episodes.environment=json:dumps"))
    too_long = [*EPISODES, "episodes.max_tokens=512"]  # an episode is one row: it must fit the policy's 256
    with pytest.raises(ConfigError, match=r"^episodes.max_tokens \(512\) exceeds the policy's max_seq_len \(256\)$"):
        run_grpo(grpo_config(setup, tmp_path, *too_long))
    assert not (tmp_path / "grpo-tiny").exists()
