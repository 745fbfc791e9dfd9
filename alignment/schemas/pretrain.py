"""The pretraining stage's config: a model, prepared data, packed windows, and the infrastructure sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from data.pretrain.config import PrepareConfig
from models.model import ModelConfig
from trainer.config import CheckpointConfig, LoggerConfig, OptimConfig, RunConfig, TrainerConfig


@dataclass
class LoaderConfig:
    seq_len: int = 256
    micro_batch_size: int = 8
    document_masking: bool = True  # False: plain causal over packed windows, as nanoGPT
    num_workers: int = 0
    val_batches: int | None = 8  # validation batches per rank each time it runs; None = whole split


@dataclass
class SampleConfig:
    prompt: str = ""  # printed with a generated continuation at the end of training ("" = skip)
    max_new_tokens: int = 64
    temperature: float = 0.8


@dataclass
class PretrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PrepareConfig = field(default_factory=PrepareConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
