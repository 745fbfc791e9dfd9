"""The PPO stage (RLHF), as a recipe: check the config, load the four models (policy and frozen reference
from SFT, critic, frozen reward model), build the prompts data, then fit ``PPOModule`` (alignment/ppo_module.py,
which owns the rollouts and the PPO update) with the callbacks every stage has.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from alignment.ppo_module import PPOModule
from alignment.responses import RewardFunction
from alignment.rewards import load_checker
from data.prompts import PromptDataModule
from data.tokenizer import Tokenizer
from models.checkpoint import load_checkpoint
from models.errors import ConfigError
from models.heads import ScalarModel, load_scalar_model
from trainer.build import check_trainer_config, fit_stage, stage_callbacks, start_run_directory
from trainer.callbacks import LossPlot
from trainer.checks import check_same_tokenizer, check_tokenizer_fits_model
from trainer.config import PPOConfig

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


def load_ppo_models(config: PPOConfig, tokenizer: Any, reward_fn: RewardFunction | None) -> dict[str, Any]:
    """Policy and reference (the SFT model), reward model and critic, checked to agree before any compute."""
    policy = load_checkpoint(config.init.policy, dtype=torch.float32)
    check_tokenizer_fits_model(tokenizer, policy.config, model_name=config.init.policy)
    check_same_tokenizer(tokenizer, config.init.policy, key="data.tokenizer")
    if config.data.max_prompt_tokens + config.ppo.response_max_tokens > policy.config.max_seq_len:
        raise ConfigError(
            f"data.max_prompt_tokens ({config.data.max_prompt_tokens}) + ppo.response_max_tokens "
            f"({config.ppo.response_max_tokens}) exceed the policy's max_seq_len ({policy.config.max_seq_len})"
        )
    # each model is read once; the trained copies are deep copies, so they share no tensor with the frozen ones
    models: dict[str, Any] = {
        "policy": policy,
        "reference": copy.deepcopy(policy),
        "reward_model": None,
        "reward_stats": {},
    }
    if reward_fn is None:
        if not config.init.reward_model:
            raise ConfigError("init.reward_model is required: the reward-model folder (`lantern rm`)")
        reward_model, metadata = load_scalar_model(config.init.reward_model)
        if reward_model.config.vocab_size != policy.config.vocab_size:
            raise ConfigError(
                f"the reward model {config.init.reward_model} has vocab_size {reward_model.config.vocab_size}, "
                f"the policy {config.init.policy} {policy.config.vocab_size}: they must share one tokenizer"
            )
        check_same_tokenizer(tokenizer, config.init.reward_model, key="data.tokenizer (the reward model's)")
        models["reward_model"] = reward_model
        models["reward_stats"] = {k: metadata[k] for k in ("reward_mean", "reward_std") if k in metadata}
    if config.init.critic == "reward_model" and models["reward_model"] is not None:
        critic = copy.deepcopy(models["reward_model"])
    elif config.init.critic == "reward_model" and config.init.reward_model:  # a reward_fn run may still name an RM
        critic = load_scalar_model(config.init.reward_model)[0]
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

    ``reward_fn`` replaces the reward model (tests, or a programmatic reward)."""
    check_trainer_config(config.trainer)  # before anything is created
    check_ppo_config(config)
    checker = load_checker(config.eval.checker, "eval.checker")
    tokenizer = Tokenizer.load(config.data.tokenizer)
    models = load_ppo_models(config, tokenizer, reward_fn)
    datamodule = PromptDataModule(config.data, batch_size=config.ppo.rollout_batch_size)
    datamodule.setup("fit")

    run_dir = start_run_directory(config)
    callbacks = [
        *stage_callbacks(config, run_dir, tokenizer, metadata={"stage": "ppo", "tokenizer": str(tokenizer.path)}),
        LossPlot(
            run_dir,
            metrics=("ppo/score", "ppo/reward"),
            title="PPO: reward-model score and total reward per rollout",
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
        config, models["policy"], models["critic"], models["reference"], models["reward_model"], tokenizer,
        reward_stats=models["reward_stats"], reward_fn=reward_fn, checker=checker,
    )  # fmt: skip
    return fit_stage(config, module, datamodule, run_dir, callbacks, validate=False)
