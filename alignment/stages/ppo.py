"""The PPO stage (``PPO``, ``run_ppo``): a reward model by default, and a critic copied from it (in its normalised
units) or a fresh value head on the policy's backbone; with LoRA the critic gets its own adapters."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import torch

from alignment.schemas.rl import PPOConfig
from alignment.shared.initial_model import add_model_adapters
from alignment.shared.responses import RewardFunction
from alignment.shared.rewards import Reward, RewardTerm, build_reward, load_reward_model_score
from alignment.stages.ppo_module import PPOModule
from alignment.stages.rl import RLAlgorithm, run_rl
from models.errors import ConfigError
from models.heads import ScalarModel
from models.model import Transformer
from trainer.callbacks import LossPlot


def ppo_reward(config: PPOConfig) -> Reward:
    """``reward.terms`` if any, else the reward model of ``init.reward_model``."""
    if config.reward.terms:
        return build_reward(config.reward.terms)
    if not config.init.reward_model:
        raise ConfigError("init.reward_model is required (the reward-model folder, `lantern rm`), or name reward.terms")
    return Reward(
        [RewardTerm("reward_model", 1.0, tokens=load_reward_model_score(config.init.reward_model, "init.reward_model"))]
    )


def normalised_critic(reward_model: ScalarModel, stats: dict[str, float]) -> ScalarModel:
    """A trainable critic copied from the reward model, its head rescaled by the model's exported ``stats`` so that
    it outputs (reward - mean) / std: the normalised units PPO's scores, and so its returns, are in (a copy in raw
    units starts far off: explained variance was -6 in the demo). Without stats, a plain copy."""
    critic = copy.deepcopy(reward_model).requires_grad_(True).train()
    if "reward_mean" in stats:
        std = max(float(stats["reward_std"]), 1e-6)
        with torch.no_grad():
            critic.head.proj.weight.div_(std)
            critic.head.proj.bias.sub_(float(stats["reward_mean"])).div_(std)
    return critic


def ppo_models(config: PPOConfig, policy: Transformer, reward: Reward) -> dict[str, ScalarModel]:
    """The critic, once the reward models are checked to share the policy's vocabulary."""
    for scorer in reward.models:
        if scorer.model.config.vocab_size != policy.config.vocab_size:
            raise ConfigError(
                f"the reward model {scorer.path} has vocab_size {scorer.model.config.vocab_size}, "
                f"the policy {config.init.policy} {policy.config.vocab_size}: they must share one tokenizer"
            )
    if critic_from_reward_model(config, reward):
        if reward.models:  # the reward is (partly) this model, in its normalised units: so are the critic's values
            critic = normalised_critic(reward.models[0].model, reward.models[0].stats)
        else:  # another reward (a checker, a function): the model's statistics say nothing of its scale
            critic = normalised_critic(load_reward_model_score(config.init.reward_model, "init.reward_model").model, {})
    else:
        critic = ScalarModel.from_backbone(copy.deepcopy(policy), init="zeros")
    return {"critic": critic.freeze_lm_head()}


def critic_from_reward_model(config: PPOConfig, reward: Reward) -> bool:
    """Whether the critic is a copy of a reward model (the reward's first, else init.reward_model's), not a fresh
    head on the policy's backbone."""
    return config.init.critic == "reward_model" and bool(reward.models or config.init.reward_model)


def ppo_adapters(config: PPOConfig, models: dict[str, ScalarModel], reward: Reward) -> dict[str, dict]:
    """With peft.kind=lora, the critic's own adapters (in place) beside its fully trained score head (``head.``),
    and its base's record: the reward model's backbone it was copied from, or the policy's as loaded."""
    if not config.peft.enabled:
        return {}
    critic = models["critic"]
    if not critic_from_reward_model(config, reward):
        source = config.init.policy
    else:
        source = reward.models[0].path if reward.models else config.init.reward_model
    return {"critic": add_model_adapters(config, critic, source, base=critic.backbone, trainable=("head.",))}


def ppo_plots(config: PPOConfig, run_dir: Path) -> list[L.Callback]:
    return [
        LossPlot(
            run_dir,
            metrics=("ppo/score", "ppo/reward"),
            title="PPO: score and total reward (score - KL penalty) per rollout",
            filename="reward.png",
            ylabel="mean per sequence",
        ),
        LossPlot(
            run_dir,
            metrics=("ppo/kl",),
            title="PPO: KL to the reference per sequence",
            filename="kl.png",
            ylabel="KL (nats)",
        ),
        LossPlot(run_dir, metrics=("ppo/policy_loss", "ppo/value_loss"), title="PPO losses", filename="loss.png"),
    ]


PPO = RLAlgorithm(
    stage="ppo",
    title="PPO",
    rollout=("rollout_batch_size",),
    module=PPOModule,
    reward=ppo_reward,
    plots=ppo_plots,
    extra_models=ppo_models,
    extra_adapters=ppo_adapters,
)


def run_ppo(
    config: PPOConfig, extra_callbacks: list | None = None, reward_fn: RewardFunction | None = None
) -> Path | None:
    """PPO through the RL recipe (``run_rl``); ``reward_fn`` replaces the configured reward."""
    return run_rl(config, PPO, extra_callbacks, reward_fn)
