"""The GRPO / RLOO stage: what GRPO brings to the RL recipe (alignment/stages/rl.py, ``run_rl``). Its reward is a
checker by default (a verifiable reward; or a reward model, exact match, or a weighted sum:
alignment/shared/rewards.py), each prompt is sampled ``grpo.group_size`` times, and there is no critic: the group is
the baseline. ``GRPOModule`` (alignment/stages/grpo_module.py) owns the rollouts and the update.

    lantern grpo configs/grpo/tiny.yaml grpo.baseline=rloo
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from alignment.schemas.rl import GRPOConfig
from alignment.shared.rewards import Reward, build_reward
from alignment.stages.grpo_module import GRPOModule
from alignment.stages.rl import RLAlgorithm, run_rl
from trainer.callbacks import LossPlot


def grpo_reward(config: GRPOConfig) -> Reward:
    return build_reward(config.reward.terms)


def grpo_plots(config: GRPOConfig, run_dir: Path) -> list[L.Callback]:
    name = config.grpo.baseline.upper()
    return [
        LossPlot(
            run_dir,
            metrics=("grpo/score", "grpo/solved_groups", "grpo/zero_variance_groups"),
            title=f"{name}: mean score of the samples, groups with a solution, groups without signal",
            filename="reward.png",
            ylabel="per rollout",
        ),
        LossPlot(
            run_dir,
            metrics=("grpo/kl",),
            title=f"{name}: KL to the reference per sequence",
            filename="kl.png",
            ylabel="KL (nats)",
        ),
        LossPlot(run_dir, metrics=("grpo/policy_loss",), title=f"{name}: policy loss", filename="loss.png"),
    ]


GRPO = RLAlgorithm(
    stage="grpo",
    title="GRPO",
    rollout=("prompts_per_rollout", "group_size"),
    module=GRPOModule,
    reward=grpo_reward,
    plots=grpo_plots,
)


def run_grpo(config: GRPOConfig, extra_callbacks: list | None = None) -> Path | None:
    """GRPO (or RLOO) through the RL recipe (``run_rl``)."""
    return run_rl(config, GRPO, extra_callbacks)
