"""Callbacks shared by every stage: atomic checkpoints, throughput/MFU, data progress, loss plots."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch

log = logging.getLogger(__name__)

LATEST = "latest"  # a file naming the newest complete checkpoint; replaced atomically


class AtomicCheckpoint(L.Callback):
    """Saves every ``every_n_steps`` optimizer steps and at the end, so that a crash never corrupts the last
    good checkpoint: each save goes to a hidden temporary path (a file, or a folder of shards under FSDP),
    is renamed into place once every rank has written, and only then does ``latest`` point at it."""

    def __init__(self, directory: str | Path, every_n_steps: int, keep_last: int = 3) -> None:
        if every_n_steps < 1 or keep_last < 1:
            raise ValueError("checkpoint.every_n_steps and checkpoint.keep_last must be >= 1")
        self.directory = Path(directory)
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self._last_saved_step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(".tmp-*"):  # left by a crash mid-save: never a good checkpoint
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        trainer.strategy.barrier("atomic-checkpoint-setup")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_saved_step:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_saved_step and not getattr(pl_module, "failed", False):
            self.save(trainer)

    def save(self, trainer: L.Trainer) -> Path:
        step = trainer.global_step
        name = f"step-{step:08d}.ckpt"
        final = self.directory / name
        temporary = self.directory / f".tmp-{name}"
        trainer.save_checkpoint(temporary, weights_only=False)  # full state: optimizer, schedule, loops
        trainer.strategy.barrier("atomic-checkpoint-written")
        if trainer.is_global_zero:
            _fsync_path(temporary)
            if final.exists():
                shutil.rmtree(final) if final.is_dir() else final.unlink()
            os.replace(temporary, final)
            _write_atomically(self.directory / LATEST, name + "\n")
            _fsync_path(self.directory)
            self._prune()
        trainer.strategy.barrier("atomic-checkpoint-done")
        self._last_saved_step = step
        return final

    def _prune(self) -> None:
        checkpoints = sorted(self.directory.glob("step-*.ckpt"))
        for old in checkpoints[: -self.keep_last]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    return path if path.exists() else None


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".tmp-{path.name}")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _fsync_path(path: Path) -> None:
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] + [path]
    for item in paths:
        try:
            fd = os.open(item, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:  # some filesystems refuse fsync on directories
            pass
        finally:
            os.close(fd)


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
        self._tokens = trainer.global_step * trainer.accumulate_grad_batches * self.tokens_per_micro_batch * trainer.world_size
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


KNOWN_PEAK_TFLOPS = {  # dense bf16 tensor-core peaks, per device
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "V100": 125.0,
    "RTX 4090": 165.0,
}


def device_peak_flops(device: torch.device, dtype: torch.dtype, configured_tflops: float | None) -> float:
    """Configured peak, else a known GPU's datasheet peak, else measured with a large matmul (CPU)."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in KNOWN_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
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
    NAME.csv). Metrics are kept in memory on rank 0."""

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

    def _record(self, trainer: L.Trainer, validation: bool) -> None:
        # callback_metrics keeps the last validation values during training: read each kind in its own hook
        for name in self.metrics:
            if name.startswith("val") != validation:
                continue
            value = trainer.callback_metrics.get(name)
            if value is None:
                continue
            series = self.history[name]
            if not series or series[-1][0] != trainer.global_step:
                series.append((trainer.global_step, float(value)))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A resumed run continues the curves it left in metrics.csv (up to the step it resumed from)."""
        previous = self.run_dir / self.csv_name
        if trainer.global_step == 0 or not previous.is_file():
            return
        with open(previous, newline="") as handle:
            for row in csv.DictReader(handle):
                if row["metric"] in self.history and int(row["step"]) <= trainer.global_step:
                    self.history[row["metric"]].append((int(row["step"]), float(row["value"])))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self._record(trainer, validation=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self._record(trainer, validation=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.write(trainer)

    def write(self, trainer: L.Trainer) -> None:
        if not trainer.is_global_zero or not any(self.history.values()):
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / self.csv_name, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["metric", "step", "value"])
            for name, series in self.history.items():
                writer.writerows((name, step, value) for step, value in series)
        from trainer.plots import plot_curves

        plot_curves(self.history, self.run_dir / self.filename, title=self.title, ylabel=self.ylabel)


def full_state_dict(model: torch.nn.Module, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (gathered from every rank under FSDP2; a collective: call on all
    ranks), with wrapper prefixes from activation checkpointing and torch.compile removed."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if isinstance(trainer.strategy, ModelParallelStrategy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return {_plain_name(name): tensor for name, tensor in state.items()}


def _plain_name(name: str) -> str:
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


class ExportFinal(L.Callback):
    """At the end of training, writes the model as a native checkpoint folder that ``load_checkpoint``,
    ``lantern generate`` and ``lantern convert`` read and the next stage starts from. A ``ScalarModel``
    (reward model, critic) is written with ``models.heads.save_scalar_model``.

    ``metadata`` may be a callable of the LightningModule, for values known only at the end (reward
    normalisation statistics)."""

    def __init__(
        self,
        directory: str | Path,
        tokenizer_path: str | None,
        metadata: dict[str, Any] | Callable[[L.LightningModule], dict[str, Any]] | None = None,
        attribute: str = "model",
    ) -> None:
        self.directory = Path(directory)
        self.tokenizer_path = tokenizer_path
        self.metadata = metadata or {}
        self.attribute = attribute
        self._exported = False

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A run resumed from its checkpoint at max_steps skips the training loop, and with it on_train_end:
        export here instead (single process; under several processes the group may be gone by now)."""
        if not self._exported and trainer.world_size == 1 and trainer.global_step >= (trainer.max_steps or 0):
            self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(pl_module, "failed", False):
            return
        from models.heads import ScalarModel

        model = getattr(pl_module, self.attribute)
        state = full_state_dict(model, trainer)
        metadata = self.metadata(pl_module) if callable(self.metadata) else dict(self.metadata)
        if trainer.is_global_zero:
            metadata = {**metadata, "step": trainer.global_step}
            if isinstance(model, ScalarModel):
                from models.heads import save_scalar_model

                save_scalar_model(model, self.directory, tokenizer_path=self.tokenizer_path, metadata=metadata, state=state)
            else:
                from models.checkpoint import save_checkpoint
                from models.model import Transformer

                with torch.device("meta"):
                    plain = Transformer(model.config)
                plain.load_state_dict(state, assign=True, strict=True)
                if model.config.tie_embeddings:
                    plain.output.weight = plain.tok_embeddings.weight
                save_checkpoint(plain, self.directory, tokenizer_path=self.tokenizer_path, metadata=metadata)
            log.info("exported the final model to %s", self.directory)
        trainer.strategy.barrier("export-final")
        self._exported = True
