"""The one recipe of the RL stages, PPO and GRPO / RLOO (``run_rl``): check the config, build the reward, load the
policy and its reference, build disjoint training and held-out prompts, then fit the stage's module. What differs
between algorithms is read from the stage's record (its rollout's shape) and its module's class methods (its
reward, extra models and their adapters, plots)."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import torch

from alignment.shared.evaluation import check_disjoint
from alignment.shared.initial_model import add_stage_adapters
from alignment.shared.responses import RewardFunction
from alignment.shared.rewards import Reward, RewardTerm, load_checker
from alignment.stages.registry import Stage
from alignment.stages.rl_module import RLModule
from data.records.prompts import PromptDataModule
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError
from models.formats.checkpoint import load_checkpoint
from models.model import Transformer
from trainer.build import check_stage_config, fit_stage, stage_callbacks, start_run_directory

log = logging.getLogger(__name__)


def check_rl_config(config: Any, stage: Stage) -> None:
    """What an RL stage needs beyond each key's range: a rollout of whole minibatches of whole micro-batches, no
    Lightning accumulation (the modules optimise by hand), a policy."""
    name, hp = stage.name, getattr(config, stage.name)
    sequences = math.prod(getattr(hp, key) for key in stage.rollout)
    if sequences % hp.minibatch_size or hp.minibatch_size % hp.micro_batch_size:
        rollout = " x ".join(f"{name}.{key}" for key in stage.rollout)
        raise ConfigError(
            f"{rollout} ({sequences} sequences) must be a multiple of {name}.minibatch_size ({hp.minibatch_size}), "
            f"and that of {name}.micro_batch_size ({hp.micro_batch_size})"
        )
    if config.trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches must be 1 for {stage.title}: "
            f"accumulate with {name}.minibatch_size / {name}.micro_batch_size"
        )
    if not config.init.policy:
        raise ConfigError(f"init.policy is required: the SFT model folder {stage.title} starts from")
    if config.peft.enabled and config.peft.dropout > 0:
        log.warning(
            "peft.dropout=%s: the rollout's old log-probs and the training pass then draw different dropout masks, so "
            "%s's first ratio is no longer exactly 1 (TRL turns dropout off for RL): peft.dropout=0 is advised",
            config.peft.dropout, stage.title,
        )  # fmt: skip


def load_policy(config: Any, stage: Stage) -> Transformer:
    """The SFT model, checked before any compute: a prompt plus a response fit its context (its tokenizer and the
    reward models' were checked by ``check_stage_config``)."""
    policy = load_checkpoint(config.init.policy, dtype=torch.float32)
    stage.check_row_tokens(config, policy.config.max_seq_len, "the policy's max_seq_len")
    return policy


def run_rl(
    config: Any,
    stage: Stage,
    extra_callbacks: list | None = None,
    reward_fn: RewardFunction | None = None,
) -> Path | None:
    """Check everything that can be checked, then run the RL ``stage``; returns the run folder on rank 0, else None.

    ``reward_fn`` replaces the configured reward (tests, or a programmatic reward over token rows)."""
    check_stage_config(config, stage.model_folders(config))  # before anything is created
    check_rl_config(config, stage)
    plan = stage.preflight(config)  # before any weights load
    checker = load_checker(config.eval.checker, "eval.checker")
    algorithm: type[RLModule] = stage.module  # its class methods: the reward, environment, extra models, plots
    environment = stage.environment(config)  # multi-turn tool episodes (the record's episodes section), or None
    tokenizer = Tokenizer.load(config.data.tokenizer)
    if reward_fn is not None:
        reward = Reward([RewardTerm("reward_fn", 1.0, tokens=reward_fn)])
    else:
        reward = algorithm.build_reward(config)
    prompts_per_rollout = getattr(getattr(config, stage.name), stage.rollout[0])
    datamodule = PromptDataModule(config.data, batch_size=prompts_per_rollout)
    datamodule.setup("fit")  # bad prompts in one line before any weights are read
    check_disjoint(datamodule.train_prompts, datamodule.val_prompts, "data.val")
    policy = load_policy(config, stage)
    # each model is read once; the trained copies are deep copies, so they share no tensor with the frozen ones.
    # The extra models come first: a critic copied from the policy is a copy of the policy as loaded, no adapters.
    extra = algorithm.extra_models(config, policy, reward)
    # peft.kind=lora: only the adapters train, and the reference is the policy's base (adapters off): no copy
    adapter_bases = add_stage_adapters(config, policy, key="policy")
    if adapter_bases:
        adapter_bases.update(algorithm.extra_adapters(config, extra, reward))
    models = {"policy": policy, "reference": None if adapter_bases else copy.deepcopy(policy), **extra}

    run_dir = start_run_directory(config, stage.name)
    metadata = {"stage": stage.name, "tokenizer": str(tokenizer.path)}
    callbacks = [
        *stage_callbacks(config, run_dir, tokenizer, metadata=metadata),
        *algorithm.plots(config, run_dir),
        *(extra_callbacks or []),
    ]
    extra_arguments = {"environment": environment} if environment is not None else {}
    module = algorithm(config, **models, reward=reward, tokenizer=tokenizer, checker=checker, **extra_arguments)
    module.adapter_bases = adapter_bases
    return fit_stage(config, module, datamodule, run_dir, callbacks, validate=False, plan=plan)
