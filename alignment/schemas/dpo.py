"""The schema of `lantern dpo`: DPOConfig and its init and loss sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from alignment.schemas.common import StageLoaderConfig
from data.preference.config import PreferenceDataConfig
from models.config_checks import bounded
from models.model import ModelConfig
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


@dataclass
class DPOInitConfig:
    policy: str | None = None  # the SFT model folder DPO starts from; None: a seeded random `model` (smoke runs)
    reference: str | None = None  # the frozen reference; None: the same weights as init.policy (the usual DPO)


@dataclass
class DPOLossConfig:
    kind: Literal["dpo", "ipo", "simpo"] = "dpo"  # dpo sums response log-probs; ipo and simpo average them
    beta: float = bounded(0.1, gt=0)  # SimPO's paper uses 2 to 10
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)  # conservative DPO (dpo and simpo; ipo has none)
    simpo_gamma: float = bounded(0.5, ge=0)  # the target margin of simpo
    # precompute: one reference pass before training, cached in the run folder; unused by simpo (no reference)
    reference_logprobs: Literal["precompute", "on_the_fly"] = "precompute"


@dataclass
class DPOConfig(StageConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(name="dpo"))
    init: DPOInitConfig = field(default_factory=DPOInitConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters (kind: lora); default: none
    model: ModelConfig = field(default_factory=ModelConfig)  # only used without init.policy
    data: PreferenceDataConfig = field(default_factory=lambda: PreferenceDataConfig(train=[]))
    loader: StageLoaderConfig = field(default_factory=StageLoaderConfig)
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=5e-5, min_lr=5e-5, warmup_steps=10, weight_decay=0.0)
    )
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=200, val_every_n_steps=50))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: HarnessEvalConfig = field(default_factory=HarnessEvalConfig)  # harness tasks at each validation
