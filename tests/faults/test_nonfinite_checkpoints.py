"""No checkpoint holds a NaN/Inf, in any stage: RL stages guard their rewards, losses and gradient norms through
the shared check (``trainer.max_nonfinite_steps``), every save checks the weights and optimizer state (a finite
loss can still end in a non-finite update), ``latest`` always names a finite checkpoint, and a rerun resumes from
the last good step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from alignment.stages.grpo import run_grpo
from alignment.stages.ppo import run_ppo
from alignment.stages.sft import run_sft
from models.errors import DataError, NonFiniteLossError
from tests.alignment.conftest import setup  # noqa: F401 - the tiny policy, reward model and prompts
from tests.alignment.test_grpo import grpo_config
from tests.alignment.test_ppo import ppo_config
from tests.alignment.test_sft import demo, sft_config  # noqa: F401 - demo is a fixture
from trainer.checkpoints import LATEST, checkpoint_step, latest_checkpoint

NAN_CHECKER = "reward.terms=[{kind: checker, path: 'tests.faults.test_nonfinite_checkpoints:nan_reward'}]"


def nan_reward(record: dict, answer: str) -> float:
    """A user's checker with a bug: NaN for every answer with an 'e' in it."""
    return math.nan if "e" in answer else 1.0


def assert_every_checkpoint_finite(run_dir: Path) -> None:
    """Every checkpoint in the run (not only the newest) holds finite tensors, and ``latest`` names one of them."""
    folder = run_dir / "checkpoints"
    saved = sorted(p for p in folder.glob("step-*.ckpt") if checkpoint_step(p) is not None) if folder.is_dir() else []
    for path in saved:
        state = torch.load(path, map_location="cpu", weights_only=True)
        tensors = list(state["state_dict"].values())
        for optimizer in state["optimizer_states"]:
            tensors += [v for s in optimizer["state"].values() for v in s.values() if torch.is_tensor(v)]
        assert all(torch.isfinite(t.float()).all() for t in tensors if t.is_floating_point()), f"{path} is not finite"
    if (folder / LATEST).exists():
        assert (folder / (folder / LATEST).read_text().strip()) in saved


@pytest.mark.parametrize("allowed", [0, 1])
def test_a_checker_returning_nan_stops_grpo_naming_the_reward_and_saves_nothing_bad(setup, tmp_path, allowed):  # noqa: F811
    config = grpo_config(
        setup, tmp_path, NAN_CHECKER, "trainer.max_steps=3", "checkpoint.every_n_steps=1",
        f"trainer.max_nonfinite_steps={allowed}",
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=r"^reward is nan for \d+ of \d+ values at step ") as error:
        run_grpo(config)
    assert_every_checkpoint_finite(tmp_path / config.run.name)
    # what is left is named as it is (before: "the newest one is the last good step" with no checkpoint at all)
    newest = latest_checkpoint(tmp_path / config.run.name / "checkpoints", verified=False)
    if newest is None:
        assert "before any checkpoint was written" in str(error.value) and "last good" not in str(error.value)
    else:
        assert f"{newest} is the last good step and a rerun resumes from it" in str(error.value)


def test_a_checker_returning_nan_stops_ppo_before_the_update_and_saves_nothing_bad(setup, tmp_path):  # noqa: F811
    """PPO with a checker term beside its critic: the NaN reaches the advantages and the critic's targets; the
    update is refused (both optimizers or neither), so no weight, optimizer state or checkpoint turns NaN."""
    config = ppo_config(setup, tmp_path, NAN_CHECKER, "trainer.max_steps=3", "checkpoint.every_n_steps=1")
    with pytest.raises(NonFiniteLossError, match=r"^reward is nan for \d+ of \d+ values at step "):
        run_ppo(config)
    assert_every_checkpoint_finite(tmp_path / config.run.name)


def test_a_finite_loss_that_ends_in_non_finite_weights_is_not_saved_and_a_rerun_resumes_the_last_good_step(
    demo,  # noqa: F811
    tmp_path,
):
    """SFT at lr 1e6 without warmup: a step's loss is finite but its update is not, so its checkpoint would hold
    NaN weights. The save is refused, the run stops naming the last good checkpoint, and a rerun resumes from it
    (and stops the same way, never past it)."""
    config = sft_config(
        demo, tmp_path, "optim.lr=1e6", "optim.warmup_steps=0", "trainer.max_steps=6", "checkpoint.every_n_steps=1",
        "trainer.val_every_n_steps=100",
    )  # fmt: skip
    run_dir = tmp_path / config.run.name
    with pytest.raises(NonFiniteLossError, match=r"not finite after step \d+: its checkpoint was not written") as first:
        run_sft(config)
    assert_every_checkpoint_finite(run_dir)
    last_good = latest_checkpoint(run_dir / "checkpoints")
    assert last_good is not None and f"the last good checkpoint is {last_good}" in str(first.value)
    with pytest.raises(NonFiniteLossError) as again:
        run_sft(config)
    assert f"the last good checkpoint is {last_good}" in str(again.value)
    assert_every_checkpoint_finite(run_dir)
    assert latest_checkpoint(run_dir / "checkpoints") == last_good


def failing_checker(record: dict, answer: str) -> float:
    """A user's checker with a bug that raises."""
    return {"a": 1.0}[answer[:0] + "missing"]


def test_a_checker_that_raises_stops_grpo_naming_it_and_the_row(setup, tmp_path):  # noqa: F811
    """Before: only the checker's own exception text (`KeyError: 'missing'`), no checker nor row named."""
    checker = "tests.faults.test_nonfinite_checkpoints:failing_checker"
    config = grpo_config(setup, tmp_path, f"reward.terms=[{{kind: checker, path: '{checker}'}}]", "trainer.max_steps=2")
    with pytest.raises(
        DataError, match=r"^reward.terms\[0\].path tests.faults.test_nonfinite_checkpoints:fail"
    ) as error:
        run_grpo(config)
    assert "raised KeyError ('missing') on the row {" in str(error.value) and "and the answer " in str(error.value)
