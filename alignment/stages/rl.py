"""The one recipe of the RL stages, PPO and GRPO / RLOO (``run_rl``): check the config, build the reward, load the
policy and its reference, build disjoint training and held-out prompts, then fit the algorithm's module. What
differs between algorithms is an ``RLAlgorithm``."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from alignment.shared.evaluation import check_disjoint
from alignment.shared.initial_model import add_stage_adapters
from alignment.shared.responses import RewardFunction
from alignment.shared.rewards import Reward, RewardTerm, load_checker
from alignment.stages.registry import stage_named
from alignment.stages.rl_module import RLModule
from data.records.prompts import PromptDataModule
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError
from models.formats.checkpoint import load_checkpoint
from models.model import Transformer
from trainer.build import check_stage_config, fit_stage, stage_callbacks, start_run_directory

log = logging.getLogger(__name__)


def no_extra_models(config: Any, policy: Transformer, reward: Reward) -> dict[str, nn.Module]:
    return {}


def no_extra_adapters(config: Any, models: dict[str, nn.Module], reward: Reward) -> dict[str, dict[str, Any]]:
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
    # with peft.kind=lora: adds the extra models' own adapters, in place, and returns their bases' records
    # by the module attribute that holds each model
    extra_adapters: Callable[[Any, dict[str, nn.Module], Reward], dict[str, dict[str, Any]]] = no_extra_adapters

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
    if config.peft.enabled and config.peft.dropout > 0:
        log.warning(
            "peft.dropout=%s: the rollout's old log-probs and the training pass then draw different dropout masks, so "
            "%s's first ratio is no longer exactly 1 (TRL turns dropout off for RL): peft.dropout=0 is advised",
            config.peft.dropout, algorithm.title,
        )  # fmt: skip


def load_policy(config: Any, algorithm: RLAlgorithm) -> Transformer:
    """The SFT model, checked before any compute: a prompt plus a response fit its context (its tokenizer and the
    reward models' were checked by ``check_stage_config``)."""
    policy = load_checkpoint(config.init.policy, dtype=torch.float32)
    stage_named(algorithm.stage).check_row_tokens(config, policy.config.max_seq_len, "the policy's max_seq_len")
    return policy


def run_rl(
    config: Any,
    algorithm: RLAlgorithm,
    extra_callbacks: list | None = None,
    reward_fn: RewardFunction | None = None,
) -> Path | None:
    """Check everything that can be checked, then run the RL stage; returns the run folder on rank 0, else None.

    ``reward_fn`` replaces the configured reward (tests, or a programmatic reward over token rows)."""
    check_stage_config(config, stage_named(algorithm.stage).model_folders(config))  # before anything is created
    check_rl_config(config, algorithm)
    plan = stage_named(algorithm.stage).preflight(config)  # before any weights load
    checker = load_checker(config.eval.checker, "eval.checker")
    tokenizer = Tokenizer.load(config.data.tokenizer)
    if reward_fn is not None:
        reward = Reward([RewardTerm("reward_fn", 1.0, tokens=reward_fn)])
    else:
        reward = algorithm.reward(config)
    prompts_per_rollout = getattr(algorithm.hyperparameters(config), algorithm.rollout[0])
    datamodule = PromptDataModule(config.data, batch_size=prompts_per_rollout)
    datamodule.setup("fit")  # bad prompts in one line before any weights are read
    check_disjoint(datamodule.train_prompts, datamodule.val_prompts, "data.val")
    policy = load_policy(config, algorithm)
    # each model is read once; the trained copies are deep copies, so they share no tensor with the frozen ones.
    # The extra models come first: a critic copied from the policy is a copy of the policy as loaded, no adapters.
    extra = algorithm.extra_models(config, policy, reward)
    # peft.kind=lora: only the adapters train, and the reference is the policy's base (adapters off): no copy
    adapter_bases = add_stage_adapters(config, policy, key="policy")
    if adapter_bases:
        adapter_bases.update(algorithm.extra_adapters(config, extra, reward))
    models = {"policy": policy, "reference": None if adapter_bases else copy.deepcopy(policy), **extra}

    run_dir = start_run_directory(config, algorithm.stage)
    metadata = {"stage": algorithm.stage, "tokenizer": str(tokenizer.path)}
    callbacks = [
        *stage_callbacks(config, run_dir, tokenizer, metadata=metadata),
        *algorithm.plots(config, run_dir),
        *(extra_callbacks or []),
    ]
    module = algorithm.module(config, **models, reward=reward, tokenizer=tokenizer, checker=checker)
    module.adapter_bases = adapter_bases
    return fit_stage(config, module, datamodule, run_dir, callbacks, validate=False, plan=plan)
