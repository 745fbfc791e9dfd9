"""Callbacks shared by every stage: the progress bar, throughput/MFU, data progress, loss plots and metrics history,
the NaN-step check and skip, the final export."""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from data.tokenizer.convert import with_hf_tokenizer_files
from models.adapters import merged_state
from models.files.atomic import check_destination, storage_error
from models.formats.checkpoint import save_checkpoint
from models.formats.tokenizer_files import as_tokenizer_files
from models.heads import ScalarModel, save_scalar_model
from models.model import Transformer
from models.model_config import adapter_config
from trainer.checkpoints import latest_checkpoint
from trainer.hardware import gpu_from_device_name, peak_flops
from trainer.parallel import plain_name
from trainer.plots import metrics_csv_rows, plot_curves, read_metrics_csv, write_metrics_csv

log = logging.getLogger(__name__)


class SkipNonFiniteSteps(L.Callback):
    """Checks the step's losses for NaN/Inf once, before the optimizer step (``LanguageModelModule.check_finite_step``:
    callbacks run before the module's own hook) and drops the gradients of a step it marks skipped
    (``skip_step``, under ``trainer.max_nonfinite_steps``), so that the optimizer leaves the weights and its own
    state as they were. Backward has run on every rank as usual: DDP and FSDP collectives stay matched."""

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        check = getattr(pl_module, "check_finite_step", None)
        if check is not None:
            check()
        if getattr(pl_module, "skip_step", None) == trainer.global_step:
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    parameter.grad = None


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar (plain progress lines that read well in logs and CI as well as in a terminal). It shows
    the training values the module logged for it (``bar_metrics``: see ``LanguageModelModule.log``) as read at the
    last logging step: a read is a host read (on a GPU, a wait for every queued kernel), made every
    ``trainer.log_every_n_steps`` optimizer steps, not every micro-batch. Closed when a run stops on an error (NaN
    loss, interrupt) so it does not print itself once more when the interpreter exits."""

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._shown: dict[str, float] = {}
        self._read_at = 0  # the global step of the last read (none before the first step)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        step = trainer.global_step
        logging_step = step % max(trainer.log_every_n_steps, 1) == 0 or step == trainer.max_steps
        if step != self._read_at and logging_step:
            self._read_at = step
            values = trainer.callback_metrics
            names = [name for name in getattr(pl_module, "bar_metrics", {}) if name in values]
            self._shown = dict(zip(names, host_values([values[name] for name in names])))
        standard = {key: metrics.pop(key) for key in ("v_num",) if key in metrics}
        return {**standard, **self._shown, **metrics}

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        for bar in (self._train_progress_bar, self._val_progress_bar):
            if bar is not None:
                bar.close()


class DataProgress(L.Callback):
    """Tells the datamodule how many micro-batches were really consumed (loaders prefetch ahead), so the
    sampler state saved in a checkpoint resumes with exactly the next sample.

    Counted when a batch starts: any checkpoint saved after it (at this batch's end or later) has trained
    on it, whatever order the callbacks' batch-end hooks run in.
    """

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.datamodule.mark_consumed(1)


class Throughput(L.Callback):
    """Logs tokens seen, tokens/s and MFU (model FLOPs over the devices' peak) every optimizer step.

    ``flops_per_token`` is the model's training FLOPs per token; ``peak_flops`` is per device.
    """

    def __init__(self, tokens_per_micro_batch: int, flops_per_token: float, peak_flops: float | None) -> None:
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._tokens = 0
        self._start: float | None = None
        self._window_tokens = 0
        self._window_start = 0.0
        self._last_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._tokens = (
            trainer.global_step * trainer.accumulate_grad_batches * self.tokens_per_micro_batch * trainer.world_size
        )
        self._window_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        batch_tokens = self.tokens_per_micro_batch * trainer.world_size
        self._tokens += batch_tokens
        self._window_tokens += batch_tokens
        if trainer.global_step == self._last_step:  # mid-accumulation
            return
        self._last_step = trainer.global_step
        if _is_cuda(pl_module):
            torch.cuda.synchronize()
        now = time.perf_counter()
        tokens_per_second = self._window_tokens / max(now - self._window_start, 1e-9)
        metrics = {"tokens_seen": float(self._tokens), "tokens_per_second": tokens_per_second}
        if self.peak_flops:
            metrics["mfu"] = tokens_per_second * self.flops_per_token / (self.peak_flops * trainer.world_size)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        if optimizer is not None:
            metrics["lr"] = optimizer.param_groups[0]["lr"]
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        self._window_tokens, self._window_start = 0, now


def _is_cuda(module: L.LightningModule) -> bool:
    return module.device.type == "cuda"


def device_peak_flops(
    device: torch.device, dtype: torch.dtype, configured_tflops: float | None, float32_matmul_precision: str = "auto"
) -> float:
    """The peak FLOP/s MFU is reported against: ``configured_tflops``, else the GPU table's peak for the dtype the
    matmuls compute in, else measured with a large matmul (CPU, a GPU not in the table)."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        gpu = gpu_from_device_name(torch.cuda.get_device_name(device))
        if gpu is not None:
            return peak_flops(gpu, "bf16-mixed" if dtype == torch.bfloat16 else "32-true", float32_matmul_precision)
    return measure_matmul_flops(device, dtype)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5) -> float:
    """Achieved FLOP/s of a square matmul, the practical peak on CPU where no datasheet applies."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    iterations, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iterations += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * iterations / (time.perf_counter() - start)


class LossPlot(L.Callback):
    """Writes a PNG of metrics against step (``loss.png``: train and validation loss) beside the run at the
    end, also when the run stops on an error, and the points as CSV (``metrics.csv`` for loss.png, else
    NAME.csv). Metrics are kept in memory on rank 0 and appended to the CSV every ``trainer.log_every_n_steps``
    optimizer steps, at validation and before every checkpoint, so that a run killed (-9) and resumed keeps its
    whole history: a resumed run keeps the rows up to the step it resumed from and records the replayed steps
    once. Every step's training values are taken when the step ends but stay where they are (on the GPU) until
    then, read in one go (one host read, not one a step). A failure to write metrics or plots (a full disk, a
    plotting error) is a warning, never the end of a run."""

    def __init__(
        self,
        run_dir: str | Path,
        metrics: tuple[str, ...] = ("train/loss", "val/loss"),
        title: str = "",
        filename: str = "loss.png",
        ylabel: str = "loss",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.metrics = metrics
        self.title = title
        self.filename = filename
        self.ylabel = ylabel
        self.csv_name = "metrics.csv" if filename == "loss.png" else Path(filename).with_suffix(".csv").name
        self.history: dict[str, list[tuple[int, float]]] = {name: [] for name in metrics}
        self._pending: list[tuple[str, int, Any]] = []  # (metric, step, value not yet read)
        self._appending = False  # rows go to the CSV as they are recorded (off after a write failed)

    def _take(self, trainer: L.Trainer, validation: bool) -> None:
        # callback_metrics keeps the last validation values during training: read each kind in its own hook
        for name in self.metrics:
            if name.startswith("val") != validation:
                continue
            value = trainer.callback_metrics.get(name)
            if value is not None and self._last_step(name) != trainer.global_step:
                self._pending.append((name, trainer.global_step, value.detach() if torch.is_tensor(value) else value))

    def _last_step(self, name: str) -> int | None:
        taken = [step for metric, step, _ in self._pending if metric == name]
        series = self.history[name]
        return taken[-1] if taken else series[-1][0] if series else None

    def _flush(self) -> None:
        """The values taken so far into the history and the CSV."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        rows = [(name, step, value) for (name, step, _), value in zip(pending, host_values([v for *_, v in pending]))]
        for name, step, value in rows:
            self.history[name].append((step, value))
        if self._appending:
            try:
                with open(self.run_dir / self.csv_name, "a") as handle:
                    handle.write(metrics_csv_rows(rows))  # one write per row set: only the last line can tear
            except OSError as error:
                self._appending = False
                warnings.warn(
                    f"cannot append to {self.run_dir / self.csv_name} ({error}); metrics stay in memory until the end"
                )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The history so far: the rows of earlier attempts up to the step this one starts from (a resumed run;
        later rows are replayed and recorded again), none for a fresh start; written back whole."""
        if not trainer.is_global_zero:
            return
        path = self.run_dir / self.csv_name
        previous = {}
        if trainer.global_step > 0 and path.is_file():
            try:
                previous = read_metrics_csv(path)
            except (OSError, UnicodeDecodeError) as error:
                warnings.warn(f"cannot read the metrics history {path} ({error}): it starts again here")
        self.history = {
            name: [(s, v) for s, v in previous.get(name, []) if s <= trainer.global_step] for name in self.metrics
        }
        self._pending = []
        self._appending = write_points(self.history, path)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self._take(trainer, validation=False)
            logging_step = trainer.global_step % max(trainer.log_every_n_steps, 1) == 0 and trainer.global_step > 0
            if logging_step or len(self._pending) >= 1024:  # (a bound for very long logging intervals)
                self._flush()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # the checkpoint's steps are never trained again after a resume: their rows must be on disk before it is
        if trainer.is_global_zero:
            self._flush()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self._take(trainer, validation=True)
            self._flush()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.is_global_zero:
            try:
                # a callback before this one (a checkpoint write) may have failed the step's end; after a NaN/Inf
                # stop the values are those of the step that was not taken
                if not getattr(pl_module, "failed", False):
                    self._take(trainer, validation=False)
                self._flush()
            except Exception as error:  # the device may be what failed: the points read so far are still written
                self._pending = []
                warnings.warn(f"cannot read the last metrics ({error!r})")
        self.write(trainer)

    def write(self, trainer: L.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        self._flush()
        if not any(self.history.values()):
            return
        png, csv = self.run_dir / self.filename, self.run_dir / self.csv_name
        write_curves(self.history, csv, png, title=self.title, ylabel=self.ylabel)


def host_values(values: list[Any]) -> list[float]:
    """Scalars as Python floats (the same floats ``float(value)`` gives), tensors read in one go: one host read
    (on a GPU, one wait for the queued kernels) for all of them."""
    tensors = [value.detach().reshape(()) for value in values if torch.is_tensor(value)]
    read = iter(torch.stack([t.to(tensors[0].device, torch.float64) for t in tensors]).tolist() if tensors else [])
    return [next(read) if torch.is_tensor(value) else float(value) for value in values]


def write_points(history: dict[str, list[tuple[int, float]]], csv_path: Path) -> bool:
    """``history`` as metric,step,value rows, replacing ``csv_path`` atomically. A failure (a full or read-only
    disk) is a warning naming the file, never the end of a run; returns whether the file was written."""
    try:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        write_metrics_csv(history, csv_path)
    except OSError as error:
        warnings.warn(f"cannot write {csv_path} ({error}); training goes on")
        return False
    return True


def write_curves(history: dict[str, list[tuple[int, float]]], csv_path: Path, png_path: Path, **plot: Any) -> None:
    """The points (``write_points``), then their plot (``plot_curves(**plot)``); a plotting failure is a warning
    that says where the points are."""
    write_points(history, csv_path)
    try:
        plot_curves(history, png_path, **plot)
    except Exception as error:
        warnings.warn(f"cannot draw {png_path} ({error!r}); the points are in {csv_path}")


def full_state_dict(model: torch.nn.Module, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (gathered from every rank under FSDP2; a collective: call on all
    ranks), with wrapper prefixes from activation checkpointing and torch.compile removed."""
    if isinstance(trainer.strategy, ModelParallelStrategy):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return {plain_name(name): tensor for name, tensor in state.items()}


class ExportFinal(L.Callback):
    """At the end of training, writes the model as a native checkpoint folder that ``load_checkpoint``,
    ``lantern generate`` and ``lantern convert`` read and the next stage starts from. A ``ScalarModel``
    (reward model, critic) is written with ``models.heads.save_scalar_model``. A model with LoRA adapters is
    written with them folded in (``lantern export --adapter`` writes the adapter alone, in peft's format).

    ``metadata`` may be a callable of the LightningModule, for values known only at the end (reward
    normalisation statistics)."""

    def __init__(
        self,
        directory: str | Path,
        tokenizer_path: str | Path | Mapping[str, Path] | None,
        metadata: dict[str, Any] | Callable[[L.LightningModule], dict[str, Any]] | None = None,
        attribute: str = "model",
    ) -> None:
        self.directory = Path(directory)
        self.tokenizer_path = tokenizer_path
        self.metadata = metadata or {}
        self.attribute = attribute
        self._exported = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Before any compute: the run's end must not find a folder here that Lantern did not write (checked
        on every rank, so that all of them stop)."""
        check_destination(self.directory, if_exists="replace-lantern")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A run resumed from its checkpoint at max_steps skips the training loop, and with it on_train_end:
        export here instead (single process; under several processes the group may be gone by now)."""
        if not self._exported and trainer.world_size == 1 and trainer.global_step >= (trainer.max_steps or 0):
            self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(pl_module, "failed", False):
            return
        model = getattr(pl_module, self.attribute)
        state = full_state_dict(model, trainer)
        metadata = self.metadata(pl_module) if callable(self.metadata) else dict(self.metadata)
        if trainer.is_global_zero:
            try:
                self._save(model, state, {**metadata, "step": trainer.global_step})
            except OSError as error:
                if isinstance(error, FileExistsError):
                    raise
                saved = latest_checkpoint(self.directory.parent / "checkpoints")
                kept = (
                    f"the training state is in {saved}: `lantern export {saved} {self.directory}` writes the model later"
                    if saved
                    else ""
                )
                raise storage_error(error, self.directory, "final model", kept=kept) from error
            log.info("exported the final model to %s", self.directory)
        trainer.strategy.barrier("export-final")
        self._exported = True

    def _save(self, model: torch.nn.Module, state: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
        peft = adapter_config(model)
        if peft is not None:
            config = model.config
            build = (lambda: ScalarModel.from_backbone(Transformer(config))) if isinstance(model, ScalarModel) else None
            state = merged_state(state, peft, build or (lambda: Transformer(config)))
        # a tiktoken tokenizer travels with its tokenizer.json too: the folder is one transformers loads as it is
        with tempfile.TemporaryDirectory(prefix="lantern-tokenizer-") as scratch:
            files = with_hf_tokenizer_files(as_tokenizer_files(self.tokenizer_path), scratch)
            if isinstance(model, ScalarModel):
                save_scalar_model(model, self.directory, tokenizer_path=files, metadata=metadata, state=state)
                return
            with torch.device("meta"):
                plain = Transformer(model.config)
            plain.load_state_dict(state, assign=True, strict=True)
            if model.config.tie_embeddings:
                plain.output.weight = plain.tok_embeddings.weight
            save_checkpoint(plain, self.directory, tokenizer_path=files, metadata=metadata)
