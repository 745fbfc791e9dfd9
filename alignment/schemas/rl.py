"""Config schemas of the RL stages, PPO and GRPO/RLOO, and the sections every stage that samples shares: the
reward (``RewardConfig``) and the held-out evaluation (``RLEvalConfig``).

Choices: a reward is a weighted sum of terms (a reward model, a checker named by import path, exact match), so a
verifiable reward, a learned one or a mix is one YAML list; the learning rate is constant by default (an RL
stage's data moves with the policy, so a schedule that decays to a known end fits it badly); PPO and GRPO share
their sampling, clipping and KL keys through one base dataclass, so the two read the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from data.records.prompts import PromptDataConfig
from models.adapter_config import PeftConfig
from trainer.config import CheckpointConfig, LoggerConfig, OptimConfig, RunConfig, TrainerConfig


def rl_optim(lr: float) -> OptimConfig:
    """A constant learning rate ``lr`` with no warmup and no weight decay: what the RL stages start from."""
    return OptimConfig(lr=lr, min_lr=lr, warmup_steps=0, weight_decay=0.0, schedule="constant")


@dataclass
class RewardTermConfig:
    kind: Literal["reward_model", "checker", "exact_match"] = "checker"
    # reward_model: the model folder (`lantern rm`), scored normalised by its training mean / std;
    # checker: "package.module:function" taking (prompt row, answer) -> score in [0, 1] or None (alignment/shared/rewards.py);
    # exact_match: 1 when the answer equals the prompt's reference answer (a trailing assistant turn or `answer`)
    path: str = ""
    weight: float = 1.0


@dataclass
class RewardConfig:
    # the reward of a response is the weighted sum of these terms; PPO with none uses init.reward_model alone
    terms: list[RewardTermConfig] = field(default_factory=list)


@dataclass
class RLEvalConfig:
    # the ground truth of held-out answers: "package.module:function" (alignment/shared/rewards.py); "" measures none.
    # The demo's: data.demo.scoring:score_example
    checker: str = ""
    generations: int = 0  # held-out prompts answered greedily at each evaluation; 0: all of them
    every_n_rollouts: int = 10
    batch_size: int = 32
    table_rows: int = 8
    pass_k: int = 8  # pass@k of k samples (temperature 1) per held-out prompt, before and after training; 0: off
    pass_k_prompts: int = 100  # held-out prompts pass@k is measured on (k samples each); 0: all


@dataclass
class RolloutHyperparameters:
    """What PPO and GRPO share: sampling the responses, the clipped ratio, the KL to the reference."""

    minibatch_size: int = 8  # sequences per rank per optimiser step
    micro_batch_size: int = 4  # sequences per forward/backward (gradient accumulation within a minibatch)
    epochs: int = 2  # passes over each rollout
    response_max_tokens: int = 32
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    clip_ratio: float = 0.2
    kl_coef: float = 0.05
    kl_estimator: Literal["k1", "k3"] = "k1"
    entropy_coef: float = 0.0
    missing_eos_penalty: float | None = 1.0  # subtracted from the score of a response without an end-of-turn
    frozen_device: Literal["same", "cpu"] = "same"  # where the reference and reward model live
    frozen_dtype: Literal["float32", "bfloat16"] = "float32"


# ---- PPO ----


@dataclass
class PPOInitConfig:
    policy: str | None = None  # the SFT model folder: policy, and frozen reference
    reward_model: str | None = None  # the reward-model folder (`lantern rm`): frozen reward, and the critic
    # reward_model: the critic starts as the reward model with its head rescaled to normalised reward units (what
    # PPO's returns are in); zeros: the policy's backbone with a fresh value head that outputs 0
    critic: Literal["reward_model", "zeros"] = "reward_model"


@dataclass
class PPOHyperparameters(RolloutHyperparameters):
    rollout_batch_size: int = 16  # prompts per rank per rollout
    clip_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    reward_clip: float | None = None  # clip normalised scores to [-c, c]
    kl_adaptive: bool = False
    kl_target: float | None = 6.0
    kl_horizon: int = 10000
    critic_warmup_rollouts: int = 0  # rollouts that train only the critic


@dataclass
class PPOConfig:
    run: RunConfig = field(default_factory=lambda: RunConfig(name="ppo"))
    init: PPOInitConfig = field(default_factory=PPOInitConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters (kind: lora); default: none
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOHyperparameters = field(default_factory=PPOHyperparameters)
    optim: OptimConfig = field(default_factory=lambda: rl_optim(1e-5))
    critic_optim: OptimConfig = field(default_factory=lambda: rl_optim(1e-5))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=100, val_every_n_steps=10**9))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_n_steps=20))
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)


# ---- GRPO / RLOO ----


@dataclass
class GRPOInitConfig:
    policy: str | None = None  # the SFT model folder: policy, and frozen reference


@dataclass
class GRPOHyperparameters(RolloutHyperparameters):
    prompts_per_rollout: int = 8  # prompts per rank per rollout; each is sampled group_size times
    group_size: int = 8  # G responses per prompt
    # grpo: (score - group mean) / group std; rloo: score - mean of the other G - 1 (leave-one-out)
    baseline: Literal["grpo", "rloo"] = "grpo"
    scale_advantages: bool = True  # grpo only: divide by the group std (False: Dr. GRPO's plain difference)
    # token: every response token weighs the same (DAPO / Dr. GRPO); sequence: every response weighs the same
    # (GRPO's paper), so a one-token answer is not outvoted by long ones in a mixed-length batch
    loss_aggregation: Literal["token", "sequence"] = "token"
    minibatch_size: int = 32
    micro_batch_size: int = 16
    epochs: int = 1
    kl_coef: float = 0.04
    kl_estimator: Literal["k1", "k3"] = "k3"  # k3 = exp(r) - r - 1 >= 0, in the loss (not the reward)
    missing_eos_penalty: float | None = None


@dataclass
class GRPOConfig:
    run: RunConfig = field(default_factory=lambda: RunConfig(name="grpo"))
    init: GRPOInitConfig = field(default_factory=GRPOInitConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters (kind: lora); default: none
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    reward: RewardConfig = field(
        default_factory=lambda: RewardConfig(terms=[RewardTermConfig("checker", "data.demo.scoring:score_example")])
    )
    grpo: GRPOHyperparameters = field(default_factory=GRPOHyperparameters)
    optim: OptimConfig = field(default_factory=lambda: rl_optim(1e-5))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=100, val_every_n_steps=10**9))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_n_steps=20))
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)
