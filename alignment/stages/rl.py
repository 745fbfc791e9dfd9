"""The one recipe of the RL stages, PPO and GRPO / RLOO alike: check the config, build the reward (alignment/shared/
rewards.py), load the policy and its frozen reference from SFT, build the prompts data (held-out prompts disjoint
from the training ones), then fit the algorithm's module with the callbacks every stage has.

What differs between the algorithms is data and a few hooks, an ``RLAlgorithm``: PPO's (a reward model by default,
a critic) is in alignment/stages/ppo.py, GRPO's (a checker by default, no critic) in alignment/stages/grpo.py. Their
modules own the rollouts and the update (ppo_module.py, grpo_module.py, over rl_module.py).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from alignment.shared.evaluation import check_disjoint
from alignment.shared.responses import RewardFunction
from alignment.shared.rewards import Reward, RewardTerm, load_checker
from alignment.stages.rl_module import RLModule
from data.records.prompts import PromptDataModule
from data.tokenizer.tokenizer import Tokenizer
from models.checkpoint import load_checkpoint
from models.errors import ConfigError
from models.model import Transformer
from trainer.build import check_stage_config, fit_stage, stage_callbacks, start_run_directory
from trainer.checks import check_context_length, check_same_tokenizer, check_tokenizer_fits_model


def no_extra_models(config: Any, policy: Transformer, reward: Reward) -> dict[str, nn.Module]:
    return {}


@dataclass(frozen=True)
class RLAlgorithm:
    """What one RL algorithm brings to the recipe (``run_rl``)."""

    stage: str  # the run's stage, the config section of its hyperparameters (RolloutHyperparameters), metrics' prefix
    title: str  # its name in messages
    # the section's keys whose product is the sequences one rollout samples per rank; the first counts its prompts
    rollout: tuple[str, ...]
    # the module class, called with keywords: policy, reference, the extra models, reward, tokenizer, checker
    module: Callable[..., RLModule]
    reward: Callable[[Any], Reward]  # the configured reward, loaded and checked
    plots: Callable[[Any, Path], list[L.Callback]]  # the stage's plots (LossPlot) in the run folder
    # the models beyond the policy and its reference (PPO's critic), by the module's keyword; they may check the reward
    extra_models: Callable[[Any, Transformer, Reward], dict[str, nn.Module]] = no_extra_models

    def hyperparameters(self, config: Any) -> Any:
        return getattr(config, self.stage)


def check_rl_config(config: Any, algorithm: RLAlgorithm) -> None:
    """What an RL stage needs beyond each key's range: a rollout of whole minibatches of whole micro-batches, no
    Lightning accumulation (the modules optimise by hand), a policy."""
    name, hp = algorithm.stage, algorithm.hyperparameters(config)
    sequences = math.prod(getattr(hp, key) for key in algorithm.rollout)
    if sequences % hp.minibatch_size or hp.minibatch_size % hp.micro_batch_size:
        rollout = " x ".join(f"{name}.{key}" for key in algorithm.rollout)
        raise ConfigError(
            f"{rollout} ({sequences} sequences) must be a multiple of {name}.minibatch_size ({hp.minibatch_size}), "
            f"and that of {name}.micro_batch_size ({hp.micro_batch_size})"
        )
    if config.trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches must be 1 for {algorithm.title}: "
            f"accumulate with {name}.minibatch_size / {name}.micro_batch_size"
        )
    if not config.init.policy:
        raise ConfigError(f"init.policy is required: the SFT model folder {algorithm.title} starts from")


def load_policy(config: Any, algorithm: RLAlgorithm, tokenizer: Any, reward: Reward) -> Transformer:
    """The SFT model, checked before any compute: the tokenizer is its own and the reward models', and a prompt plus
    a response fit its context."""
    policy = load_checkpoint(config.init.policy, dtype=torch.float32)
    check_tokenizer_fits_model(tokenizer, policy.config, model_name=config.init.policy)
    check_same_tokenizer(tokenizer, config.init.policy, key="data.tokenizer")
    response_max_tokens = algorithm.hyperparameters(config).response_max_tokens
    check_context_length(
        {
            "data.max_prompt_tokens": config.data.max_prompt_tokens,
            f"{algorithm.stage}.response_max_tokens": response_max_tokens,
        },
        policy.config.max_seq_len,
        "the policy's max_seq_len",
    )
    for scorer in reward.models:
        check_same_tokenizer(tokenizer, scorer.path, key="data.tokenizer (the reward model's)")
    return policy


def run_rl(
    config: Any,
    algorithm: RLAlgorithm,
    extra_callbacks: list | None = None,
    reward_fn: RewardFunction | None = None,
) -> Path | None:
    """Check everything that can be checked, then run the RL stage; returns the run folder on rank 0, else None.

    ``reward_fn`` replaces the configured reward (tests, or a programmatic reward over token rows)."""
    check_stage_config(config)  # before anything is created
    check_rl_config(config, algorithm)
    checker = load_checker(config.eval.checker, "eval.checker")
    tokenizer = Tokenizer.load(config.data.tokenizer)
    if reward_fn is not None:
        reward = Reward([RewardTerm("reward_fn", 1.0, tokens=reward_fn)])
    else:
        reward = algorithm.reward(config)
    policy = load_policy(config, algorithm, tokenizer, reward)
    # each model is read once; the trained copies are deep copies, so they share no tensor with the frozen ones
    models = {"policy": policy, "reference": copy.deepcopy(policy), **algorithm.extra_models(config, policy, reward)}
    prompts_per_rollout = getattr(algorithm.hyperparameters(config), algorithm.rollout[0])
    datamodule = PromptDataModule(config.data, batch_size=prompts_per_rollout)
    datamodule.setup("fit")
    check_disjoint(datamodule.train_prompts, datamodule.val_prompts, "data.val")

    run_dir = start_run_directory(config, algorithm.stage)
    metadata = {"stage": algorithm.stage, "tokenizer": str(tokenizer.path)}
    callbacks = [
        *stage_callbacks(config, run_dir, tokenizer, metadata=metadata),
        *algorithm.plots(config, run_dir),
        *(extra_callbacks or []),
    ]
    module = algorithm.module(config, **models, reward=reward, tokenizer=tokenizer, checker=checker)
    return fit_stage(config, module, datamodule, run_dir, callbacks, validate=False)
