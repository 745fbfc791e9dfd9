"""The GRPO / RLOO stage, as a recipe: check the config, build the reward (a checker by default: a verifiable
reward; or a reward model, exact match, or a weighted sum: alignment/shared/rewards.py), load the policy and its frozen
reference from SFT, build the prompts data (held-out prompts disjoint from the training ones), then fit
``GRPOModule`` (alignment/stages/grpo_module.py) with the callbacks every stage has.

    lantern grpo configs/grpo/tiny.yaml grpo.baseline=rloo
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from alignment.schemas.rl import GRPOConfig
from alignment.shared.evaluation import check_disjoint
from alignment.shared.rewards import build_reward, load_checker
from alignment.stages.grpo_module import GRPOModule
from data.records.prompts import PromptDataModule
from data.tokenizer.tokenizer import Tokenizer
from models.checkpoint import load_checkpoint
from models.errors import ConfigError
from trainer.build import check_trainer_config, fit_stage, stage_callbacks, start_run_directory
from trainer.callbacks import LossPlot
from trainer.checks import check_same_tokenizer, check_tokenizer_fits_model


def check_grpo_config(config: GRPOConfig) -> None:
    """What GRPO needs beyond each key's range: whole groups in every minibatch, no Lightning accumulation, a policy."""
    grpo = config.grpo
    sequences = grpo.prompts_per_rollout * grpo.group_size
    if sequences % grpo.minibatch_size or grpo.minibatch_size % grpo.micro_batch_size:
        raise ConfigError(
            f"grpo.prompts_per_rollout x grpo.group_size ({sequences} sequences) must be a multiple of "
            f"grpo.minibatch_size ({grpo.minibatch_size}), and that of grpo.micro_batch_size ({grpo.micro_batch_size})"
        )
    if config.trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches must be 1 for GRPO: accumulate with grpo.minibatch_size / grpo.micro_batch_size"
        )
    if not config.init.policy:
        raise ConfigError("init.policy is required: the SFT model folder GRPO starts from")


def run_grpo(config: GRPOConfig, extra_callbacks: list | None = None) -> Path | None:
    """Check everything that can be checked, then run GRPO (or RLOO); returns the run folder on rank 0, else None."""
    check_trainer_config(config.trainer)  # before anything is created
    check_grpo_config(config)
    checker = load_checker(config.eval.checker, "eval.checker")
    reward = build_reward(config.reward.terms)
    tokenizer = Tokenizer.load(config.data.tokenizer)
    policy = load_checkpoint(config.init.policy, dtype=torch.float32)
    check_tokenizer_fits_model(tokenizer, policy.config, model_name=config.init.policy)
    check_same_tokenizer(tokenizer, config.init.policy, key="data.tokenizer")
    for scorer in reward.models:
        check_same_tokenizer(tokenizer, scorer.path, key="data.tokenizer (the reward model's)")
    if config.data.max_prompt_tokens + config.grpo.response_max_tokens > policy.config.max_seq_len:
        raise ConfigError(
            f"data.max_prompt_tokens ({config.data.max_prompt_tokens}) + grpo.response_max_tokens "
            f"({config.grpo.response_max_tokens}) exceed the policy's max_seq_len ({policy.config.max_seq_len})"
        )
    datamodule = PromptDataModule(config.data, batch_size=config.grpo.prompts_per_rollout)
    datamodule.setup("fit")
    check_disjoint(datamodule.train_prompts, datamodule.val_prompts, "data.val")

    run_dir = start_run_directory(config, "grpo")
    name = config.grpo.baseline.upper()
    callbacks = [
        *stage_callbacks(config, run_dir, tokenizer, metadata={"stage": "grpo", "tokenizer": str(tokenizer.path)}),
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
        *(extra_callbacks or []),
    ]
    module = GRPOModule(config, policy, copy.deepcopy(policy), reward, tokenizer, checker=checker)
    return fit_stage(config, module, datamodule, run_dir, callbacks, validate=False)
