"""Trainer, strategy, precision and logger construction from a stage config, shared by every stage."""

from __future__ import annotations

import datetime
import json
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path, PurePath
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import LambdaCallback
from lightning.pytorch.loggers import Logger

from models.errors import LanternError
from models.files.atomic import StorageError, storage_error, write_atomically
from trainer.callbacks import (
    DataProgress,
    ExportFinal,
    ProgressBar,
    SkipNonFiniteSteps,
    Throughput,
    device_peak_flops,
)
from trainer.checks import check_resumable, resolve_resume, resolve_stage_tokenizer
from trainer.config import (
    CPU_OFFLOAD_NEEDS_GPUS,
    ConfigError,
    HarnessEvalConfig,
    TrainerConfig,
    to_dict,
    to_yaml,
)
from trainer.interrupts import say_if_sigint_ignored
from trainer.loggers import close_logger, make_logger
from trainer.optim import OptimSettingsOnResume
from trainer.parallel import FSDP2Strategy
from trainer.plan import planned_precision
from trainer.plan_check import PlannedRun, PlanVersusMeasured
from trainer.stopping import StoppingDDPStrategy
from trainer.storage import (
    AtomicCheckpoint,
    claim_run_directory,
    is_global_rank_zero,
    lock_run_directory,
    release_run_directory,
)

log = logging.getLogger(__name__)


class _WithoutAdvert(logging.Filter):
    """Drops Lightning's tip to install its cloud logger (litlogger), which every Trainer prints: noise a user did
    not ask for, about a service Lantern does not use."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_WithoutAdvert())


def run_directory(out_dir: str, name: str) -> Path:
    """OUT_DIR/NAME, where NAME must stay inside OUT_DIR: a run writes, locks and may replace what is in it."""
    name_path = PurePath(name)
    if not name.strip() or not name_path.parts or name_path.is_absolute() or ".." in name_path.parts:
        raise ConfigError(f"run.name must name a folder inside run.out_dir ({out_dir}), such as 'my-run'; got {name!r}")
    return Path(out_dir) / name


def start_run_directory(config: Any, stage: str, data_stats: dict[str, Any] | None = None) -> Path:
    """The stage's run folder (run.out_dir / run.name), claimed and locked (global rank 0), with the resolved config
    in config.yaml and ``data_stats`` in data_stats.json; a folder not this run's is refused before anything in it
    changes. ``fit_stage`` releases the lock."""
    run_dir = run_directory(config.run.out_dir, config.run.name)
    try:
        claim_run_directory(run_dir, stage)
        if is_global_rank_zero():
            lock_run_directory(run_dir)
        check_resumable(run_dir, config)
        write_atomically(run_dir / "config.yaml", to_yaml(config), what="run config")
        if data_stats is not None:
            write_atomically(
                run_dir / "data_stats.json", json.dumps(data_stats, indent=2, default=str), what="data statistics"
            )
    except LanternError:
        release_run_directory(run_dir)
        raise
    except OSError as error:
        release_run_directory(run_dir)
        raise LanternError(
            str(error if isinstance(error, StorageError) else storage_error(error, run_dir, "run folder"))
        ) from error
    return run_dir


def peak_flops(config: TrainerConfig) -> float:
    """The peak FLOP/s Throughput reports MFU against: trainer.peak_tflops, else the device's in the dtype
    trainer.precision computes in."""
    device = torch.device("cuda" if _runs_on_cuda(config) else "cpu")
    dtype = torch.bfloat16 if config.precision.startswith("bf16") else torch.float32
    return device_peak_flops(device, dtype, config.peak_tflops, config.float32_matmul_precision)


def check_stage_config(
    config: Any, folders: tuple[str | None, Sequence[tuple[str, str]]], trainer: TrainerConfig | None = None
) -> None:
    """What every stage does first, before anything is created, on a config already checked at load: pairs
    ``data.tokenizer`` with every model the stage reads (``folders``: the one it starts from and the others, as
    its record declares them, ``Stage.model_folders``), and readies the trainer section (``trainer``: the config's
    own unless given) for this machine."""
    prepare_trainer(config.trainer if trainer is None else trainer)
    resolve_stage_tokenizer(config, *folders)


def prepare_trainer(config: TrainerConfig) -> None:
    """Once per run, before any model is built or any matmul runs: refuse GPU-only options on a machine without
    GPUs, resolve ``auto`` precision and compile (recorded in config.yaml) and set torch's matmul precision."""
    if config.cpu_offload and not torch.cuda.is_available():
        raise ConfigError(CPU_OFFLOAD_NEEDS_GPUS.format(prefix="trainer."))
    resolve_precision(config)
    resolve_compile(config)
    apply_float32_matmul_precision(config)


def _runs_on_cuda(config: TrainerConfig) -> bool:
    return torch.cuda.is_available() and config.accelerator != "cpu"


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU (AVX-512 BF16 or AMX); without them a bf16 matmul takes a
    reference path several times slower than fp32 (measured 5.5x for 1024x128x4096 on an AVX2-only CPU)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(config: TrainerConfig) -> str:
    """trainer.precision ``auto`` becomes the fast choice of the device the run uses: ``bf16-mixed`` on a GPU
    with bf16 (fp32 master weights, bf16 compute), ``32-true`` on CPU. An explicit bf16 precision on a CPU
    without native bf16 kernels is honoured with a warning that says what it costs."""
    on_cuda = _runs_on_cuda(config)
    if config.precision == "auto":
        config.precision = planned_precision("auto", on_gpu=on_cuda and torch.cuda.is_bf16_supported())
    elif config.precision.startswith("bf16") and not on_cuda and not cpu_has_native_bf16():
        warnings.warn(
            f"trainer.precision={config.precision} on a CPU without native bf16 kernels (no AVX-512 BF16 / AMX): "
            "bf16 matmuls run several times slower than fp32 here; trainer.precision=auto picks 32-true on CPU",
            stacklevel=2,
        )
    return config.precision


def resolve_compile(config: TrainerConfig) -> bool:
    """trainer.compile ``auto`` becomes true when the run uses CUDA and false on CPU; true and false are kept."""
    if config.compile == "auto":
        config.compile = _runs_on_cuda(config)
    return config.compile


def apply_float32_matmul_precision(config: TrainerConfig) -> str:
    """Set torch's float32 matmul precision from trainer.float32_matmul_precision (``auto``: ``high`` on CUDA,
    ``highest`` elsewhere) and return what was set."""
    value = config.float32_matmul_precision
    if value == "auto":
        value = "high" if _runs_on_cuda(config) else "highest"
    torch.set_float32_matmul_precision(value)
    return value


def collective_timeout(config: TrainerConfig) -> datetime.timedelta:
    """trainer.collective_timeout_s as the process group's timeout (DDP and FSDP2 alike): a collective that waits
    longer for another rank fails, so the ranks left when a node dies or hangs exit non-zero."""
    return datetime.timedelta(seconds=config.collective_timeout_s)


def collective_failure_note(config: TrainerConfig) -> L.Callback:
    """A callback that, when a collective fails because another rank is gone (gloo: the connection reset or
    closed) or silent past trainer.collective_timeout_s (timed out), logs one line saying so on each rank that
    stops; the error itself follows as raised."""

    def note(trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        text = str(exception)
        lost = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
        # gloo words a timeout two ways, by where it strikes: "Timed out waiting Nms" in a collective, and
        # "Application timeout caused pair closure" in a barrier
        timed_out = "timed out" in text.lower() or "application timeout" in text.lower()
        if trainer.world_size < 2 or not (timed_out or any(s in text for s in lost)):
            return
        cause = "stopped responding" if timed_out else "died"
        log.error(
            "rank %d stops: another rank %s (a node down or hung; trainer.collective_timeout_s=%g bounds the wait)",
            trainer.global_rank,
            cause,
            config.collective_timeout_s,
        )

    return LambdaCallback(on_exception=note)


def make_strategy(config: TrainerConfig) -> Any:
    if config.strategy == "single":
        return "auto"
    if config.strategy == "ddp":
        return StoppingDDPStrategy(timeout=collective_timeout(config))  # SIGTERM: all ranks stop at one step

    # Pure FSDP2: one data-parallel dimension over every device of every node.
    return FSDP2Strategy(
        data_parallel_size=config.devices * config.num_nodes,
        tensor_parallel_size=1,
        timeout=collective_timeout(config),
    )


def lightning_precision(config: TrainerConfig) -> str:
    # Under FSDP2, bf16-mixed is FSDP's MixedPrecisionPolicy (bf16 parameters for compute, fp32 master weights,
    # fp32 gradient reduction); Lightning must not add autocast on top.
    if config.strategy == "fsdp" and config.precision == "bf16-mixed":
        return "32-true"
    return config.precision


def make_trainer(
    config: TrainerConfig,
    *,
    run_dir: Path,
    callbacks: list[L.Callback],
    logger: Logger | bool,
    max_steps: int | None = None,
    validate: bool = True,
) -> L.Trainer:
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
        callbacks=[ProgressBar(refresh_rate=1), collective_failure_note(config), *callbacks],
        enable_checkpointing=False,  # AtomicCheckpoint saves instead
        use_distributed_sampler=False,  # the datamodules shard (and resume) their own samplers
        default_root_dir=str(run_dir),
        enable_model_summary=False,
    )


def stage_callbacks(
    config: Any,
    run_dir: Path,
    tokenizer: Any,
    *,
    metadata: dict[str, Any] | Callable[[L.LightningModule], dict[str, Any]],
    throughput: tuple[int, float] | None = None,
) -> list[L.Callback]:
    """What every stage has: data progress (exact resume), atomic checkpoints every ``checkpoint.every_n_steps``,
    throughput and MFU when ``throughput`` = (tokens per micro-batch, FLOPs per token) is given, and the export
    of ``final/`` with the tokenizer and ``metadata``, and the ``eval`` section's harness tasks at each validation.
    ``fit_stage`` puts them in save order."""
    callbacks: list[L.Callback] = [
        DataProgress(),
        AtomicCheckpoint(run_dir / "checkpoints", config.checkpoint.every_n_steps, config.checkpoint.keep_last),
        ExportFinal(run_dir / "final", tokenizer.files, metadata=metadata),
    ]
    if throughput is not None:
        callbacks.append(Throughput(*throughput, peak_flops(config.trainer)))
    harness = getattr(config, "eval", None)
    if isinstance(harness, HarnessEvalConfig) and harness.harness_tasks:
        from trainer.harness_validation import HarnessScorer, HarnessValidation  # lm-eval: the eval extra

        scorer = HarnessScorer(harness, tokenizer, key="eval.", folder=run_dir / "harness")
        callbacks.append(HarnessValidation(scorer))
    return callbacks


def in_save_order(callbacks: list[L.Callback]) -> list[L.Callback]:
    """``callbacks`` with the checkpoint after every recorder of a step and the final export last: a kill between a
    step's row and its checkpoint must not lose the row, and a failed export must not cost the training."""
    saving = [c for c in callbacks if isinstance(c, AtomicCheckpoint)]
    exporting = [c for c in callbacks if isinstance(c, ExportFinal)]
    return [c for c in callbacks if c not in saving and c not in exporting] + saving + exporting


def fit_stage(
    config: Any,
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    run_dir: Path,
    callbacks: list[L.Callback],
    *,
    validate: bool = True,
    plan: PlannedRun | None = None,
) -> Path | None:
    """The end every stage shares: logger, trainer, resume and fit, the run held against its pre-flight ``plan``
    at the end. Returns run_dir on rank 0, None on the other ranks."""
    logger: Logger | bool = False
    if plan is not None:
        callbacks = [*callbacks, PlanVersusMeasured(plan, run_dir)]
    try:
        resume = resolve_resume(config.checkpoint, run_dir / "checkpoints", getattr(config, "model", None), config)
        # the same W&B run as before when training resumes from this folder's checkpoint
        logger = make_logger(config.logger, run_dir, config.run.name, to_dict(config), resume=resume)
        callbacks = [*in_save_order(callbacks), SkipNonFiniteSteps(), OptimSettingsOnResume()]
        trainer = make_trainer(config.trainer, run_dir=run_dir, callbacks=callbacks, logger=logger, validate=validate)
        say_if_sigint_ignored()
        with warnings.catch_warnings():
            # Lightning 2.6's own pytree code builds torch's deprecated LeafSpec, and torch >= 2.10 warns about it
            # once a stage: nothing the user did or can change (Lightning's issue), so it is not shown.
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
            trainer.fit(module, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    except (StorageError, FileExistsError) as error:  # a full or read-only disk, or final/ not Lantern's: one line
        raise LanternError(str(error)) from error
    finally:
        close_logger(logger)
        release_run_directory(run_dir)
    return run_dir if trainer.is_global_zero else None
