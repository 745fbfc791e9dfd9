"""The reward model stage's config, with the policy's own samples labelled by a checker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from alignment.schemas.common import InitConfig, StageLoaderConfig
from data.preference.config import PreferenceDataConfig
from models.config_checks import bounded
from models.model import ModelConfig
from models.model_config import PeftConfig
from trainer.config import CheckpointConfig, LoggerConfig, OptimConfig, RunConfig, StageConfig, TrainerConfig


@dataclass
class RMLossConfig:
    margin: float = bounded(0.0, ge=0)  # Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin)
    normalize_rewards: bool = True  # export the train-set reward mean / std for PPO to normalise with
    normalization_pairs: int = bounded(2000, ge=1)  # train pairs (both sides scored) the mean / std are measured on


@dataclass
class PolicySamplesConfig:
    """The policy's own samples labelled by a checker: pairs to train on (the best of ``samples_per_prompt`` answers
    over the worst) and the trained model's agreement with the checker on held-out prompts; off unless both
    ``policy`` and ``checker`` are set."""

    policy: str | None = None  # the model to sample from: the SFT policy the reward model will guide
    checker: str = ""  # "package.module:function", e.g. data.demo.scoring:score_example
    prompts: list[str] = field(default_factory=list)  # training prompts the pairs are sampled from
    heldout: list[str] = field(default_factory=list)  # prompts the agreement is measured on; empty: not measured
    train: Literal["add", "replace", "none"] = "add"  # the pairs join data.train, replace it, or only measure
    samples_per_prompt: int = bounded(4, ge=1)
    max_prompts: int = bounded(0, ge=0)  # prompts sampled from each list; 0: all of them
    temperature: float = bounded(1.0, ge=0)
    response_max_tokens: int = bounded(48, ge=1)
    batch_size: int = bounded(16, ge=1)


@dataclass
class RMConfig(StageConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(name="rm"))
    init: InitConfig = field(default_factory=InitConfig)  # checkpoint: the SFT model folder
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters (kind: lora); default: none
    model: ModelConfig = field(default_factory=ModelConfig)  # only used without init.checkpoint
    data: PreferenceDataConfig = field(default_factory=lambda: PreferenceDataConfig(train=[]))
    loader: StageLoaderConfig = field(default_factory=StageLoaderConfig)
    loss: RMLossConfig = field(default_factory=RMLossConfig)
    policy_samples: PolicySamplesConfig = field(default_factory=PolicySamplesConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-5, min_lr=1e-6, warmup_steps=20, weight_decay=0.0)
    )
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=200, val_every_n_steps=50))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
