"""The GRPO / RLOO stage (``GRPO``, ``run_grpo``): a checker by default, ``grpo.group_size`` samples per prompt and
no critic (the group is the baseline).

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
