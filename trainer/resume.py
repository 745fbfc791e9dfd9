"""What a run resumes, checked before it does: a checkpoint of this run's model, optimizer and strategy, with steps
left to train; ``resolve_resume`` names the checkpoint (``checkpoint.resume``: auto, none or a path)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from models.errors import CheckpointError, ConfigError
from models.formats.checkpoint_io import architecture_differences
from models.model import ModelConfig
from trainer.checkpoints import checkpoint_step, has_checkpoints, latest_checkpoint, read_checkpoint_header
from trainer.config import CheckpointConfig
from trainer.schedules import check_resumed_optim

log = logging.getLogger("trainer.build")


def check_steps_left(checkpoint: Path, step: int, config: Any) -> None:
    """A resume from a checkpoint already past ``trainer.max_steps`` is refused: Lightning would stop at once and
    the run export the step-``step`` model as if it had trained to max_steps, config.yaml saying so."""
    trainer = getattr(config, "trainer", None)
    if trainer is not None and step > trainer.max_steps:
        raise ConfigError(
            f"trainer.max_steps={trainer.max_steps}: {checkpoint} is already at step {step}; set trainer.max_steps "
            f"above {step} to train on from it, or run.name to another folder for a new run"
        )


def check_resumed_model(run_dir: Path, config: Any) -> None:
    """A run folder whose checkpoints ``checkpoint.resume=auto`` would resume must be resumed with the model they
    hold (config.yaml records it): another one is refused in one line naming both, before config.yaml changes."""
    model = getattr(config, "model", None)
    if model is None or config.checkpoint.resume != "auto" or not has_checkpoints(run_dir / "checkpoints"):
        return
    try:
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))["model"]
        previous = ModelConfig.from_dict(recorded)
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return  # no readable record: the checkpoint's own shapes are checked when it loads (LanguageModelModule)
    differences = describe_differences(previous, model)
    if differences:
        raise ConfigError(
            f"model: {run_dir} holds checkpoints of another model {differences}: resume it with "
            "its own model, or set run.name to a new folder (or checkpoint.resume=none there) to start afresh"
        )


def resolve_resume(
    config: CheckpointConfig, checkpoint_dir: Path, model: ModelConfig | None = None, stage: Any = None
) -> str | None:
    """The checkpoint to resume: ``auto`` the newest of this run that verifies and loads, if any; ``none`` none; else
    the path given. One of another model than ``model``, or of another optimizer or past a WSD cooldown's start than
    the ``stage`` config's (``check_resumed_optim``), is refused in one line naming both."""
    if config.resume == "none":
        return None
    if config.resume == "auto":
        found = latest_checkpoint(checkpoint_dir)
        if found is None:
            return None
        log.info("resuming from %s", found)
        path = found
    else:
        path = Path(config.resume)
        if not path.exists():
            raise ConfigError(f"checkpoint.resume: {path} does not exist")
    trainer = getattr(stage, "trainer", None)
    if path.is_dir() and trainer is not None and trainer.strategy != "fsdp":
        # a sharded (FSDP2, torch.distributed.checkpoint) folder: only the strategy that wrote it reads it as state
        raise ConfigError(
            f"checkpoint.resume: {path} is a sharded checkpoint an FSDP run wrote (a folder of shards), but "
            f"trainer.strategy is {trainer.strategy}: resume it with trainer.strategy=fsdp, or export it (lantern "
            "export) and start a run from that model with init.checkpoint"
        )
    try:
        header = read_checkpoint_header(path)
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint.resume: {error}") from None
    saved = ((header.get("hyper_parameters") or {}).get("config") or {}).get("model")
    if model is not None and isinstance(saved, dict):
        differences = describe_differences(ModelConfig.from_dict(saved), model)
        if differences:
            raise ConfigError(f"checkpoint.resume: {path} is a checkpoint of another model {differences}")
    if config.resume != "auto" and isinstance(header.get("global_step"), int):  # auto: start_run_directory did
        check_steps_left(path, header["global_step"], stage)
    if stage is not None:
        check_resumed_optim(stage, header, str(path))
    return str(path)


def describe_differences(saved: ModelConfig, configured: ModelConfig) -> str:
    """'(dim 128, ...) than the config's (dim 512, ...)' for the architecture fields that differ; '' if none."""
    differences = architecture_differences(saved, configured)
    if not differences:
        return ""
    was = ", ".join(f"{key} {old}" for key, old, _ in differences)
    now = ", ".join(f"{key} {new}" for key, _, new in differences)
    return f"({was}) than the config's ({now})"


def check_resumable(run_dir: Path, config: Any) -> None:
    """Before config.yaml changes: what ``checkpoint.resume=auto`` would resume in ``run_dir`` is of this model and
    has steps left under ``trainer.max_steps``."""
    check_resumed_model(run_dir, config)
    if config.checkpoint.resume == "auto":
        found = latest_checkpoint(run_dir / "checkpoints", verified=False)
        if found is not None:
            check_steps_left(found, checkpoint_step(found), config)
