"""The SFT stage's config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from alignment.schemas.common import EvalConfig, InitConfig, StageLoaderConfig
from data.sft.rows import SFTDataConfig
from models.model import ModelConfig
from models.model_config import PeftConfig
from trainer.config import CheckpointConfig, LoggerConfig, OptimConfig, RunConfig, StageConfig, TrainerConfig


@dataclass
class SFTLossConfig:
    reduction: Literal["token", "example"] = "token"


@dataclass
class SFTConfig(StageConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(name="sft"))
    init: InitConfig = field(default_factory=InitConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters (kind: lora); default: none
    model: ModelConfig = field(default_factory=ModelConfig)  # only used without init.checkpoint
    data: SFTDataConfig = field(default_factory=lambda: SFTDataConfig(train=[]))
    loader: StageLoaderConfig = field(default_factory=StageLoaderConfig)
    loss: SFTLossConfig = field(default_factory=SFTLossConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=1e-4, min_lr=1e-5, warmup_steps=20, weight_decay=0.0)
    )
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=200, val_every_n_steps=50))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
