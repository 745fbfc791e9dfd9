"""Every stage steps through one path in ``LanguageModelModule``: one loss normalisation (``loss_to_backpropagate``),
the NaN/Inf guard and clipping on automatic and manual (RL) updates alike, and one way of counting global steps."""

from __future__ import annotations

import csv
import inspect
import math
from types import SimpleNamespace

import pytest
import torch

import trainer.lm_module as lm_module
from alignment.stages.dpo import DPOModule
from alignment.stages.grpo import GRPOModule, run_grpo
from alignment.stages.ppo import PPOModule
from alignment.stages.pretrain import PretrainModule, run_pretrain
from alignment.stages.reward import RewardModule
from alignment.stages.sft import SFTModule, run_sft
from models.errors import NonFiniteLossError
from tests.alignment.conftest import setup  # noqa: F401 - the tiny policy, reward model and prompts
from tests.alignment.test_grpo import TOY, grpo_config
from tests.alignment.test_pretrain_run import tiny_config
from tests.alignment.test_sft import demo, sft_config  # noqa: F401 - demo is a fixture
from trainer.checkpoints import checkpoint_step, latest_checkpoint
from trainer.lm_module import LanguageModelModule

STAGE_MODULES = (PretrainModule, SFTModule, RewardModule, DPOModule, PPOModule, GRPOModule)


def module_on(world_size: int, accumulate: int, *, step_metrics: tuple[str, ...] = ("loss",)) -> LanguageModelModule:
    """A bare module whose trainer is a stand-in with ``world_size`` ranks and ``accumulate`` micro-batches a step."""
    module = LanguageModelModule(SimpleNamespace(trainer=SimpleNamespace(max_nonfinite_steps=0)))
    module.step_metrics = step_metrics
    trainer = SimpleNamespace(world_size=world_size, accumulate_grad_batches=accumulate, global_step=0)
    module._trainer = trainer
    module._step_sums = torch.zeros(len(step_metrics))
    return module


def test_the_one_normalisation_undoes_rank_averaging_and_accumulation_and_notes_the_share():
    module = module_on(world_size=2, accumulate=3)
    share = torch.tensor(0.25, requires_grad=True)
    backpropagated = module.loss_to_backpropagate(share)
    assert backpropagated.item() == 0.25 * 2 * 3
    backpropagated.backward()
    assert share.grad.item() == 6.0  # the gradient of the step's loss, once DDP averages and Lightning divides
    assert module._step_sums.tolist() == [0.25]  # the step's metric adds up the shares
    assert [what for what, _ in module._step_values] == ["loss"]  # the NaN/Inf check sees the share
    module.loss_to_backpropagate(torch.tensor(0.5), metrics=torch.tensor([0.125]))
    assert module._step_sums.tolist() == [0.375]


def test_on_one_process_the_share_is_backpropagated_bit_for_bit():
    module = module_on(world_size=1, accumulate=1)
    share = torch.tensor(1.0) / torch.tensor(3.0)
    assert torch.equal(module.loss_to_backpropagate(share), share)


@pytest.mark.parametrize("stage", STAGE_MODULES, ids=lambda cls: cls.__name__)
def test_every_stage_backpropagates_through_the_one_normalisation(stage):
    """Its training code hands its loss to ``loss_to_backpropagate`` and scales nothing by the ranks itself."""
    code = "".join(
        inspect.getsource(member)
        for cls in stage.__mro__
        if cls.__module__.startswith("alignment.")
        for name, member in vars(cls).items()
        if inspect.isfunction(member) and name in ("training_step", "update", "optimise")
    )
    assert "self.loss_to_backpropagate(" in code
    assert "world_size" not in code
    assert "manual_backward(" not in code or "manual_backward(self.loss_to_backpropagate(" in code
    assert not hasattr(stage, "step_share") and not hasattr(stage, "_count_rollout")


def test_an_rl_step_is_counted_in_one_base_class_method():
    rl_module = inspect.getmodule(GRPOModule.__mro__[1])
    assert all("fit_loop" not in inspect.getsource(inspect.getmodule(cls)) for cls in (GRPOModule, PPOModule))
    assert "fit_loop" not in inspect.getsource(rl_module) and "self.count_global_step()" in inspect.getsource(rl_module)
    assert inspect.getsource(lm_module).count("fit_loop") == 1  # count_global_step's one internal access


@pytest.fixture
def normalised_by(monkeypatch) -> list[str]:
    """The module class of every call of the one normalisation, in order."""
    called: list[str] = []
    original = LanguageModelModule.loss_to_backpropagate

    def recorded(self, share, metrics=None):
        called.append(type(self).__name__)
        return original(self, share, metrics)

    monkeypatch.setattr(LanguageModelModule, "loss_to_backpropagate", recorded)
    return called


def test_pretraining_and_sft_steps_go_through_the_one_normalisation(data_dir, demo, tmp_path, normalised_by):  # noqa: F811
    called = normalised_by
    run_pretrain(
        tiny_config(
            data_dir, tmp_path / "pretrain", "trainer.max_steps=1", "loader.micro_batch_size=2", "sample.prompt="
        )
    )
    run_sft(sft_config(demo, tmp_path / "sft", "trainer.max_steps=1", "trainer.val_every_n_steps=100"))
    assert "PretrainModule" in called and "SFTModule" in called


def test_a_grpo_run_clips_its_updates_through_the_shared_path_and_counts_rollouts_as_steps(
    setup,  # noqa: F811
    tmp_path,
    monkeypatch,
    normalised_by,
):
    """2 rollouts of 2 updates each: global_step 2 and a checkpoint named step 2; every update's gradients are
    clipped to optim.grad_clip, the norm before clipping is logged, and the losses went through the one path."""
    clip = 1e-3
    clipped: list[tuple[float, float]] = []  # (norm before, norm after) of each update
    original_clip = lm_module.grad_norm_and_clip

    def measured(parameters, max_norm):
        parameters = list(parameters)
        norm = original_clip(parameters, max_norm)
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters if p.grad is not None]))
        clipped.append((float(norm), float(after)))
        assert max_norm == clip
        return norm

    shares = normalised_by
    monkeypatch.setattr(lm_module, "grad_norm_and_clip", measured)
    config = grpo_config(
        setup, tmp_path, TOY, "trainer.max_steps=2", "checkpoint.every_n_steps=1", f"optim.grad_clip={clip}",
        "eval.every_n_rollouts=100", "eval.pass_k=0", "logger.kind=csv",
    )  # fmt: skip
    run_dir = run_grpo(config)
    assert len(clipped) == 4  # 16 responses a rollout, minibatches of 8
    assert all(after == pytest.approx(min(before, clip), rel=1e-4) for before, after in clipped), clipped
    assert any(before > clip for before, _ in clipped), clipped
    assert shares and set(shares) == {"GRPOModule"}
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint_step(checkpoint) == 2
    assert torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"] == 2
    with open(run_dir / "csv" / "metrics.csv", newline="") as handle:
        logged = [
            float(row["grpo/policy_grad_norm"]) for row in csv.DictReader(handle) if row.get("grpo/policy_grad_norm")
        ]
    assert logged == pytest.approx([clipped[1][0], clipped[3][0]])  # each rollout's last update, before clipping


def test_a_manual_update_with_a_non_finite_gradient_norm_steps_nothing():
    """``apply_update`` runs the automatic path's check: a NaN gradient stops the run before any optimizer steps."""
    module = module_on(world_size=1, accumulate=1)
    layer = torch.nn.Linear(2, 1)
    layer.weight.grad = torch.full_like(layer.weight, math.nan)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    before = layer.weight.detach().clone()
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(NonFiniteLossError, match="^policy gradient norm is nan at step 0"):
        module.apply_update((optimizer, schedule, layer, 1.0, "policy"))
    assert torch.equal(layer.weight, before)
