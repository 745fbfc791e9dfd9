"""The pretraining stage's config: a model (random, or continued from a checkpoint), prepared data, packed windows,
and the infrastructure sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from data.pretrain.config import PrepareConfig
from models.config_checks import bounded
from models.errors import ConfigError
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
class PretrainInitConfig:
    """Continued pretraining: the model to start from instead of random weights (its shape, family, tokenizer and
    chat template come with it)."""

    # a native / Hugging Face / Meta folder, a .gguf file or a training checkpoint (.ckpt or sharded folder)
    checkpoint: str | None = None

    def check_fields(self, prefix: str) -> None:
        from trainer.model_sources import source_problem

        if self.checkpoint and (problem := source_problem(self.checkpoint)):
            raise ConfigError(f"{prefix}checkpoint: {problem}")


# chosen per run, not part of the weights' shape: a continued model may set it
RUNTIME_MODEL_KEYS = ("attention",)


def model_section_conflicts(configured: ModelConfig, checkpoint: ModelConfig) -> list[str]:
    """The keys a ``model`` section sets away from the schema's defaults to other values than the checkpoint's, as
    ``model.KEY: configured vs checkpoint`` (a section left at its defaults sets nothing)."""
    default = ModelConfig()
    return [
        f"model.{f.name}={getattr(configured, f.name)!r} but the checkpoint's is {getattr(checkpoint, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in RUNTIME_MODEL_KEYS
        and getattr(configured, f.name) != getattr(default, f.name)
        and getattr(configured, f.name) != getattr(checkpoint, f.name)
    ]


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
    init: PretrainInitConfig = field(default_factory=PretrainInitConfig)
    model: ModelConfig = field(default_factory=ModelConfig)  # with init.checkpoint: the checkpoint's
    data: PrepareConfig = field(default_factory=PrepareConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: HarnessEvalConfig = field(default_factory=HarnessEvalConfig)  # harness tasks at each validation
    sample: SampleConfig = field(default_factory=SampleConfig)

    def check_fields(self, prefix: str) -> None:
        super().check_fields(prefix)
        if not self.init.checkpoint:
            return
        if self.trainer.init_device == "meta":
            raise ConfigError(
                f"{prefix}trainer.init_device 'meta' builds random weights after sharding; with {prefix}init.checkpoint "
                "the checkpoint's weights are read on the CPU first: leave it at 'cpu'"
            )
        from pathlib import Path

        from trainer.model_sources import source_model_config

        if not Path(self.init.checkpoint).expanduser().exists():
            return  # written later (a conversion, an earlier phase): refused before use if still missing
        try:
            checkpoint = source_model_config(self.init.checkpoint)
        except (OSError, ValueError) as error:
            raise ConfigError(f"{prefix}init.checkpoint: {self.init.checkpoint} is unreadable ({error})") from error
        conflicts = model_section_conflicts(self.model, checkpoint)
        if conflicts:
            raise ConfigError(
                f"{prefix}init.checkpoint {self.init.checkpoint} does not fit the model section: {conflicts[0]}"
                + (f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else "")
                + "; leave the model section out (the checkpoint's shape is used) or match it"
            )
