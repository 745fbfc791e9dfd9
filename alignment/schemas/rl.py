"""Config schemas of the RL stages, PPO and GRPO / RLOO, and the sections every sampling stage shares: the reward
(``RewardConfig``) and the held-out evaluation (``RLEvalConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from data.records.prompts import PromptDataConfig
from models.config_checks import bounded
from models.errors import ConfigError
from models.model_config import PeftConfig
from trainer.config import (
    CheckpointConfig,
    HarnessEvalConfig,
    LoggerConfig,
    OptimConfig,
    RunConfig,
    StageConfig,
    TrainerConfig,
)


def rl_optim(lr: float) -> OptimConfig:
    """A constant learning rate ``lr`` with no warmup and no weight decay: what the RL stages start from."""
    return OptimConfig(lr=lr, min_lr=lr, warmup_steps=0, weight_decay=0.0, schedule="constant")


@dataclass
class RewardTermConfig:
    kind: Literal["reward_model", "checker", "exact_match"] = "checker"
    # reward_model: a `lantern rm` folder (scores normalised); checker: "package.module:function" of (prompt row,
    # answer) -> score in [0, 1] or None; exact_match: 1 when the answer is the prompt's reference answer
    path: str = ""
    weight: float = 1.0


@dataclass
class RewardConfig:
    # the reward of a response is the weighted sum of these terms; PPO with none uses init.reward_model alone
    terms: list[RewardTermConfig] = field(default_factory=list)


@dataclass
class RLEvalConfig(HarnessEvalConfig):  # its harness tasks are scored at each held-out evaluation
    checker: str = ""  # held-out answers' ground truth, "package.module:function"; "": none measured
    generations: int = bounded(0, ge=0)  # held-out prompts answered greedily at each evaluation; 0: all of them
    every_n_rollouts: int = bounded(10, ge=1)
    batch_size: int = bounded(32, ge=1)
    table_rows: int = bounded(8, ge=0)
    pass_k: int = bounded(8, ge=0)  # pass@k of k samples (temperature 1) per held-out prompt, before and after; 0: off
    pass_k_prompts: int = bounded(100, ge=0)  # held-out prompts pass@k is measured on (k samples each); 0: all


@dataclass
class RolloutHyperparameters:
    """What PPO and GRPO share: sampling the responses, the clipped ratio, the KL to the reference."""

    minibatch_size: int = bounded(8, ge=1)  # sequences per rank per optimiser step
    micro_batch_size: int = bounded(4, ge=1)  # sequences per forward/backward (accumulated within a minibatch)
    epochs: int = bounded(2, ge=1)  # passes over each rollout
    response_max_tokens: int = bounded(32, ge=1)
    temperature: float = bounded(1.0, ge=0)  # 0: greedy rollouts
    top_k: int | None = bounded(None, ge=1)
    top_p: float | None = bounded(None, gt=0, le=1)
    clip_ratio: float = bounded(0.2, gt=0)
    kl_coef: float = bounded(0.05, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k1"
    entropy_coef: float = bounded(0.0, ge=0)
    # subtracted from the score of a response without an end-of-turn
    missing_eos_penalty: float | None = bounded(1.0, ge=0)
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
    rollout_batch_size: int = bounded(16, ge=1)  # prompts per rank per rollout
    clip_value: float = bounded(0.2, gt=0)
    gamma: float = bounded(1.0, ge=0, le=1)
    lam: float = bounded(0.95, ge=0, le=1)
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    reward_clip: float | None = bounded(None, gt=0)  # clip normalised scores to [-c, c]
    kl_adaptive: bool = False
    kl_target: float | None = bounded(6.0, gt=0)
    kl_horizon: int = bounded(10000, ge=1)
    critic_warmup_rollouts: int = bounded(0, ge=0)  # rollouts that train only the critic

    def check_fields(self, prefix: str) -> None:
        if self.kl_adaptive and self.kl_target is None:
            raise ConfigError(f"{prefix}kl_adaptive needs a {prefix}kl_target (the KL per sequence it steers toward)")


@dataclass
class EpisodeConfig:
    """Multi-turn tool episodes (alignment/shared/episodes.py, docs/tools.md): each rollout's responses are episodes
    in which the policy calls the environment's tools; the stage's response_max_tokens is then one turn's limit."""

    # "package.module:Class", an Environment; "alignment.shared.episodes:Environment": the calculator on the prompt's
    # own messages; "": single-turn responses
    environment: str = ""
    max_turns: int = bounded(4, ge=1)  # policy turns per episode
    max_tokens: int = bounded(512, ge=2)  # tokens of a whole episode: its first messages, every turn and observation

    @property
    def enabled(self) -> bool:
        return bool(self.environment)


@dataclass
class PPOConfig(StageConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(name="ppo"))
    init: PPOInitConfig = field(default_factory=PPOInitConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters (kind: lora); default: none
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOHyperparameters = field(default_factory=PPOHyperparameters)
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    optim: OptimConfig = field(default_factory=lambda: rl_optim(1e-5))
    critic_optim: OptimConfig = field(default_factory=lambda: rl_optim(1e-5))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=100, val_every_n_steps=10**9))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_n_steps=20))
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)

    def schedule_steps(self) -> int:
        """Optimizer updates over the run (policy and critic alike): each rollout's epochs over its minibatches."""
        ppo = self.ppo
        return self.trainer.max_steps * ppo.epochs * (ppo.rollout_batch_size // ppo.minibatch_size)


# ---- GRPO / RLOO ----


@dataclass
class GRPOInitConfig:
    policy: str | None = None  # the SFT model folder: policy, and frozen reference


@dataclass
class GRPOHyperparameters(RolloutHyperparameters):
    prompts_per_rollout: int = bounded(8, ge=1)  # prompts per rank per rollout; each is sampled group_size times
    group_size: int = bounded(8, gt=1)  # G responses per prompt: a group of one has no baseline
    # grpo: (score - group mean) / group std; rloo: score - mean of the other G - 1 (leave-one-out)
    baseline: Literal["grpo", "rloo"] = "grpo"
    scale_advantages: bool = True  # grpo only: divide by the group std (False: Dr. GRPO's plain difference)
    # token: every response token weighs the same (DAPO / Dr. GRPO); sequence: every response weighs the same
    # (GRPO's paper), so a one-token answer is not outvoted by long ones in a mixed-length batch
    loss_aggregation: Literal["token", "sequence"] = "token"
    minibatch_size: int = bounded(32, ge=1)
    micro_batch_size: int = bounded(16, ge=1)
    epochs: int = bounded(1, ge=1)
    kl_coef: float = bounded(0.04, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"  # k3 = exp(r) - r - 1 >= 0, in the loss (not the reward)
    missing_eos_penalty: float | None = bounded(None, ge=0)


@dataclass
class GRPOConfig(StageConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(name="grpo"))
    init: GRPOInitConfig = field(default_factory=GRPOInitConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters (kind: lora); default: none
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    reward: RewardConfig = field(
        default_factory=lambda: RewardConfig(terms=[RewardTermConfig("checker", "data.demo.scoring:score_example")])
    )
    grpo: GRPOHyperparameters = field(default_factory=GRPOHyperparameters)
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    optim: OptimConfig = field(default_factory=lambda: rl_optim(1e-5))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=100, val_every_n_steps=10**9))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_n_steps=20))
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)

    def schedule_steps(self) -> int:
        """Optimizer updates over the run: each rollout's epochs over the minibatches of its sampled responses."""
        grpo = self.grpo
        return (
            self.trainer.max_steps * grpo.epochs * (grpo.prompts_per_rollout * grpo.group_size // grpo.minibatch_size)
        )
