"""Trainer, strategy, precision and logger construction from a stage config, shared by every stage."""

from __future__ import annotations

import json
import logging
import os
import socket
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

from trainer.callbacks import device_peak_flops, latest_checkpoint
from trainer.config import CheckpointConfig, ConfigError, LoggerConfig, TrainerConfig, to_dict, to_yaml

log = logging.getLogger(__name__)


def run_directory(out_dir: str, name: str) -> Path:
    return Path(out_dir) / name


def start_run_directory(config: Any, data_stats: dict[str, Any] | None = None) -> Path:
    """The stage's run folder (run.out_dir / run.name), created, with the resolved config written to config.yaml
    and, when given, the datamodule's loading statistics to data_stats.json."""
    run_dir = run_directory(config.run.out_dir, config.run.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    if data_stats is not None:
        (run_dir / "data_stats.json").write_text(json.dumps(data_stats, indent=2, default=str))
    return run_dir


def peak_flops(config: TrainerConfig) -> float:
    """The peak FLOP/s Throughput reports MFU against: trainer.peak_tflops, else the device's (see
    trainer.callbacks.device_peak_flops) in the dtype trainer.precision computes in."""
    on_gpu = torch.cuda.is_available() and config.accelerator != "cpu"
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if config.precision.startswith("bf16") else torch.float32
    return device_peak_flops(device, dtype, config.peak_tflops)


def check_trainer_config(config: TrainerConfig) -> None:
    """The checks Lightning would only make after launching processes, made up front with key names."""
    if config.strategy == "single" and (config.devices != 1 or config.num_nodes != 1):
        raise ConfigError(
            f"trainer.strategy 'single' runs one process, but trainer.devices={config.devices} and "
            f"trainer.num_nodes={config.num_nodes}: use 'ddp' or 'fsdp' for more"
        )
    for key in ("devices", "num_nodes", "max_steps", "accumulate_grad_batches", "val_every_n_steps", "log_every_n_steps"):
        if getattr(config, key) < 1:
            raise ConfigError(f"trainer.{key} must be >= 1, got {getattr(config, key)}")
    if config.cpu_offload and config.strategy != "fsdp":
        raise ConfigError("trainer.cpu_offload needs trainer.strategy 'fsdp'")
    if config.cpu_offload and (config.accelerator == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("trainer.cpu_offload moves FSDP shards from GPU memory to pinned CPU memory: it needs GPUs")
    if config.init_device == "meta" and config.strategy != "fsdp":
        raise ConfigError("trainer.init_device 'meta' needs trainer.strategy 'fsdp' (weights materialise after sharding)")


def make_strategy(config: TrainerConfig) -> Any:
    if config.strategy == "single":
        return "auto"
    if config.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    from lightning.pytorch.strategies import ModelParallelStrategy

    # Pure FSDP2: one data-parallel dimension over every device of every node.
    return ModelParallelStrategy(data_parallel_size=config.devices * config.num_nodes, tensor_parallel_size=1)


def lightning_precision(config: TrainerConfig) -> str:
    # Under FSDP2, bf16-mixed is FSDP's MixedPrecisionPolicy (bf16 compute, fp32 master weights and gradient
    # reduction), applied in trainer/parallel.py; Lightning must not add autocast on top.
    if config.strategy == "fsdp" and config.precision == "bf16-mixed":
        return "32-true"
    return config.precision


def wandb_mode(config: LoggerConfig) -> str:
    """offline unless asked otherwise and an API key and the W&B server are both there."""
    if config.mode != "auto":
        return config.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if not os.environ.get("WANDB_API_KEY"):
        return "offline"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        log.warning("W&B server %s unreachable: logging offline (sync later with `wandb sync`)", host)
        return "offline"
    return "online"


class SafeWandbLogger(WandbLogger):
    """A W&B logger whose failures are warnings: a full disk or a dropped connection never stops training."""

    def _guard(self, action: str, function, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_lantern_broken", False):
            return None
        try:
            return function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - logging must never crash a run
            self._lantern_broken = True
            warnings.warn(f"W&B {action} failed ({error!r}); W&B logging is off for the rest of this run")
            return None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._guard("log_metrics", super().log_metrics, metrics, step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self._guard("log_hyperparams", super().log_hyperparams, params, *args, **kwargs)

    def log_table(self, *args: Any, **kwargs: Any) -> None:
        self._guard("log_table", super().log_table, *args, **kwargs)

    def log_image(self, *args: Any, **kwargs: Any) -> None:
        self._guard("log_image", super().log_image, *args, **kwargs)

    def finalize(self, status: str) -> None:
        self._guard("finalize", super().finalize, status)
        if status != "running":
            self._guard("finish", self._finish)

    def _finish(self) -> None:
        import wandb

        # Close the run so the offline folder is complete when the process carries on (tests, pipelines).
        if self._experiment is not None and wandb.run is not None:
            wandb.finish()


def make_logger(config: LoggerConfig, run_dir: Path, run_name: str, hyperparameters: dict[str, Any]) -> Logger | bool:
    if config.kind == "none":
        return False
    if config.kind == "csv":
        return CSVLogger(save_dir=str(run_dir), name="csv", version="")
    mode = wandb_mode(config)
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        logger = SafeWandbLogger(
            project=config.project,
            name=run_name,
            save_dir=str(run_dir),
            group=config.group,
            tags=list(config.tags),
            mode=mode,
            config=hyperparameters,
            settings=_wandb_settings(),
        )
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"cannot start W&B ({error!r}); logging to CSV in {run_dir / 'csv'} instead")
        return CSVLogger(save_dir=str(run_dir), name="csv", version="")
    return logger


def _wandb_settings() -> Any:
    import wandb

    # No console capture and no system-stats thread: fewer moving parts in offline CPU runs.
    return wandb.Settings(console="off", x_disable_stats=True, silent=True)


def resolve_resume(config: CheckpointConfig, checkpoint_dir: Path) -> str | None:
    """``auto``: the newest complete checkpoint of this run, if any; ``none``: start fresh; else a path."""
    if config.resume == "none":
        return None
    if config.resume == "auto":
        found = latest_checkpoint(checkpoint_dir)
        if found is not None:
            log.info("resuming from %s", found)
        return str(found) if found else None
    path = Path(config.resume)
    if not path.exists():
        raise ConfigError(f"checkpoint.resume: {path} does not exist")
    return str(path)


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, closed when a run stops on an error (NaN loss, interrupt) so it does not print
    itself once more when the interpreter exits."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        for bar in (self._train_progress_bar, self._val_progress_bar):
            if bar is not None:
                bar.close()


def make_trainer(
    config: TrainerConfig,
    *,
    run_dir: Path,
    callbacks: list[L.Callback],
    logger: Logger | bool,
    max_steps: int | None = None,
    validate: bool = True,
) -> L.Trainer:
    check_trainer_config(config)
    return L.Trainer(
        accelerator=config.accelerator,
        devices=config.devices,
        num_nodes=config.num_nodes,
        strategy=make_strategy(config),
        precision=lightning_precision(config),
        max_steps=max_steps or config.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=config.accumulate_grad_batches,
        # Lightning counts validation intervals in micro-batches; the config counts optimizer steps.
        val_check_interval=config.val_every_n_steps * config.accumulate_grad_batches if validate else None,
        check_val_every_n_epoch=None,
        limit_val_batches=None if validate else 0,
        num_sanity_val_steps=0,
        log_every_n_steps=config.log_every_n_steps,
        logger=logger,
        # tqdm: plain progress lines that read well in logs and CI as well as in a terminal
        callbacks=[ProgressBar(refresh_rate=1), *callbacks],
        enable_checkpointing=False,  # trainer.callbacks.AtomicCheckpoint saves instead
        use_distributed_sampler=False,  # the datamodules shard (and resume) their own samplers
        default_root_dir=str(run_dir),
        enable_model_summary=False,
    )


def fit_stage(
    config: Any,
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    run_dir: Path,
    callbacks: list[L.Callback],
    *,
    validate: bool = True,
) -> Path | None:
    """The end every stage shares: logger, trainer, resume (checkpoint.resume, from run_dir/checkpoints) and fit.
    Returns run_dir on rank 0, None on the other ranks."""
    logger = make_logger(config.logger, run_dir, config.run.name, to_dict(config))
    trainer = make_trainer(config.trainer, run_dir=run_dir, callbacks=callbacks, logger=logger, validate=validate)
    resume = resolve_resume(config.checkpoint, run_dir / "checkpoints")
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    return run_dir if trainer.is_global_zero else None
