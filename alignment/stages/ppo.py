"""The PPO stage (RLHF), as a recipe: check the config, build the reward (a reward model, a checker, or a weighted
sum: alignment/shared/rewards.py), load the policy and frozen reference from SFT and the critic, build the prompts data
(held-out prompts disjoint from the training ones), then fit ``PPOModule`` (alignment/stages/ppo_module.py,
which owns the rollouts and the PPO update) with the callbacks every stage has.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from alignment.schemas.rl import PPOConfig
from alignment.shared.evaluation import check_disjoint
from alignment.shared.responses import RewardFunction
from alignment.shared.rewards import Reward, RewardTerm, build_reward, load_checker, load_reward_model_score
from alignment.stages.ppo_module import PPOModule
from data.records.prompts import PromptDataModule
from data.tokenizer.tokenizer import Tokenizer
from models.checkpoint import load_checkpoint
from models.errors import ConfigError
from models.heads import ScalarModel
from trainer.build import check_trainer_config, fit_stage, stage_callbacks, start_run_directory
from trainer.callbacks import LossPlot
from trainer.checks import check_same_tokenizer, check_tokenizer_fits_model

log = logging.getLogger(__name__)


def check_ppo_config(config: PPOConfig) -> None:
    """What PPO needs beyond each key's range: batch sizes that divide, no Lightning accumulation, a policy."""
    ppo = config.ppo
    if ppo.rollout_batch_size % ppo.minibatch_size or ppo.minibatch_size % ppo.micro_batch_size:
        raise ConfigError(
            f"ppo.rollout_batch_size ({ppo.rollout_batch_size}) must be a multiple of ppo.minibatch_size "
            f"({ppo.minibatch_size}), and that of ppo.micro_batch_size ({ppo.micro_batch_size})"
        )
    if config.trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches must be 1 for PPO: accumulate with ppo.minibatch_size / ppo.micro_batch_size"
        )
    if not config.init.policy:
        raise ConfigError("init.policy is required: the SFT model folder PPO starts from")


def ppo_reward(config: PPOConfig, reward_fn: RewardFunction | None) -> Reward:
    """``reward.terms`` if any, else the reward model of ``init.reward_model``; ``reward_fn`` (tests, or a
    programmatic reward over token rows) replaces both."""
    if reward_fn is not None:
        return Reward([RewardTerm("reward_fn", 1.0, tokens=reward_fn)])
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


def load_ppo_models(config: PPOConfig, tokenizer: Any, reward: Reward) -> dict[str, Any]:
    """Policy and reference (the SFT model) and the critic, checked to agree with the reward before any compute."""
    policy = load_checkpoint(config.init.policy, dtype=torch.float32)
    check_tokenizer_fits_model(tokenizer, policy.config, model_name=config.init.policy)
    check_same_tokenizer(tokenizer, config.init.policy, key="data.tokenizer")
    if config.data.max_prompt_tokens + config.ppo.response_max_tokens > policy.config.max_seq_len:
        raise ConfigError(
            f"data.max_prompt_tokens ({config.data.max_prompt_tokens}) + ppo.response_max_tokens "
            f"({config.ppo.response_max_tokens}) exceed the policy's max_seq_len ({policy.config.max_seq_len})"
        )
    for scorer in reward.models:
        if scorer.model.config.vocab_size != policy.config.vocab_size:
            raise ConfigError(
                f"the reward model {scorer.path} has vocab_size {scorer.model.config.vocab_size}, "
                f"the policy {config.init.policy} {policy.config.vocab_size}: they must share one tokenizer"
            )
        check_same_tokenizer(tokenizer, scorer.path, key="data.tokenizer (the reward model's)")
    # each model is read once; the trained copies are deep copies, so they share no tensor with the frozen ones
    models: dict[str, Any] = {"policy": policy, "reference": copy.deepcopy(policy)}
    if config.init.critic == "reward_model" and (reward.models or config.init.reward_model):
        if reward.models:  # the reward is (partly) this model, in its normalised units: so are the critic's values
            critic = normalised_critic(reward.models[0].model, reward.models[0].stats)
        else:  # another reward (a checker, a function): the model's statistics say nothing of its scale
            critic = normalised_critic(load_reward_model_score(config.init.reward_model, "init.reward_model").model, {})
    else:
        critic = ScalarModel.from_backbone(copy.deepcopy(policy), init="zeros")
    if not critic.config.tie_embeddings:
        critic.backbone.output.weight.requires_grad_(
            False
        )  # the critic never uses an LM head; DDP needs every trained weight used
    models["critic"] = critic
    return models


def run_ppo(
    config: PPOConfig, extra_callbacks: list | None = None, reward_fn: RewardFunction | None = None
) -> Path | None:
    """Check everything that can be checked, then run PPO; returns the run folder on rank 0, else None.

    ``reward_fn`` replaces the configured reward (tests, or a programmatic reward over token rows)."""
    check_trainer_config(config.trainer)  # before anything is created
    check_ppo_config(config)
    checker = load_checker(config.eval.checker, "eval.checker")
    tokenizer = Tokenizer.load(config.data.tokenizer)
    reward = ppo_reward(config, reward_fn)
    models = load_ppo_models(config, tokenizer, reward)
    datamodule = PromptDataModule(config.data, batch_size=config.ppo.rollout_batch_size)
    datamodule.setup("fit")
    check_disjoint(datamodule.train_prompts, datamodule.val_prompts, "data.val")

    run_dir = start_run_directory(config, "ppo")
    callbacks = [
        *stage_callbacks(config, run_dir, tokenizer, metadata={"stage": "ppo", "tokenizer": str(tokenizer.path)}),
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
        *(extra_callbacks or []),
    ]
    module = PPOModule(
        config, models["policy"], models["critic"], models["reference"], reward, tokenizer, checker=checker
    )
    return fit_stage(config, module, datamodule, run_dir, callbacks, validate=False)
