"""The pretraining stage's config: a model, prepared data, packed windows, and the infrastructure sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from data.pretrain.config import PrepareConfig
from models.config_checks import bounded
from models.model import ModelConfig
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
class LoaderConfig:
    seq_len: int = bounded(256, ge=1)
    micro_batch_size: int = bounded(8, ge=1)
    document_masking: bool = True  # False: plain causal over packed windows, as nanoGPT
    num_workers: int = bounded(0, ge=0)
    val_batches: int | None = bounded(8, ge=1)  # validation batches per rank each time it runs; None = whole split


@dataclass
class SampleConfig:
    prompt: str = ""  # printed with a generated continuation at the end of training ("" = skip)
    max_new_tokens: int = bounded(64, ge=1)
    temperature: float = bounded(0.8, ge=0)


@dataclass
class PretrainConfig(StageConfig):
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PrepareConfig = field(default_factory=PrepareConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: HarnessEvalConfig = field(default_factory=HarnessEvalConfig)  # harness tasks at each validation
    sample: SampleConfig = field(default_factory=SampleConfig)
