"""Every run held against its plan: the plan's peak memory and step time beside what the run measured, recorded at
the end of training (``plan_vs_measured.json``, ``plan/*`` in metrics.csv and W&B's summary), with one warning when
the measured peak is more than 15% above the plan.

What is measured: on CUDA, the allocator's peak (``torch.cuda.max_memory_allocated``, what the plan counts: the CUDA
context is outside both). On CPU, memory in use: the process's resident memory less what glibc's malloc holds free
for reuse (``mallinfo2``), sampled at the end of every forward (the saved activations all alive) and every step, less
what was in use before the stage loaded its weights; the backward's working set falls between samples, so it is a
lower bound of the peak. The resident peak, freed blocks glibc keeps included (about twice the activations on
SmolLM2 SFT, docs/plan.md), is recorded beside it. Without glibc, resident memory alone, said so. Step time: the
median over optimizer steps after the first two (compilation, warm-up), rank 0's.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from models.files.atomic import StorageError, write_atomically
from models.memory import GiB

log = logging.getLogger(__name__)

OVER_PLAN = 1.15  # a measured peak above the plan by more than this warns once
WARM_UP_STEPS = 2  # steps left out of the step time (compilation, the allocator's first growth)
RECORD = "plan_vs_measured.json"


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (2.33 and later), or None where this process has none (musl, macOS)."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def malloc_free_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its arenas (``fordblks``, every arena): freed memory it keeps, mostly still
    resident, for the next allocations; None without glibc."""
    function = _mallinfo2()
    return None if function is None else int(function().fordblks)


def host_memory_now() -> tuple[int, int]:
    """(resident memory, in use: resident less malloc's free bytes, what the process's tensors, weights and Python
    objects hold now; the resident memory alone without glibc), from one read of each."""
    resident = resident_bytes()
    return resident, resident - (malloc_free_bytes() or 0)


@dataclass(frozen=True)
class PlannedRun:
    """What the stage's plan said before any weights were loaded, and the memory the process held then."""

    line: str
    peak_bytes: int
    step_s: float | None  # None: no step time planned (a CPU run)
    device: str
    in_use_before: int  # host memory in use (host_memory_now) before the weights loaded


class PlanVersusMeasured(L.Callback):
    """Measures the run's peak memory and step time and records them beside ``planned`` when training ends."""

    def __init__(self, planned: PlannedRun, run_dir: Path) -> None:
        self.planned = planned
        self.run_dir = Path(run_dir)
        self._ends: list[float] = []
        self._last_step = -1
        self._in_use_peak = self._resident_peak = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._sample(pl_module)

    def _sample(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cpu":
            resident, in_use = host_memory_now()
            self._resident_peak = max(self._resident_peak, resident)
            self._in_use_peak = max(self._in_use_peak, in_use)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._sample(pl_module)  # the end of the forward: every saved activation alive

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._sample(pl_module)
        if trainer.global_step != self._last_step:  # an optimizer step ended (not mid-accumulation)
            self._last_step = trainer.global_step
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        record = self.measure(pl_module.device)
        if record["peak_ratio"] is not None and record["peak_ratio"] > OVER_PLAN:
            log.warning(
                "plan: measured peak %.2f GiB is %.0f%% above the plan's %.2f GiB (%s): the plan under-counts this "
                "run; please report it with %s",
                record["measured_peak_bytes"] / GiB, 100 * (record["peak_ratio"] - 1), self.planned.peak_bytes / GiB,
                record["memory_measured_as"], RECORD,
            )  # fmt: skip
        try:
            write_atomically(self.run_dir / RECORD, json.dumps(record, indent=1) + "\n", what="plan record")
        except (OSError, StorageError) as error:  # a record, like a metric: losing it never loses the training
            log.warning("plan: %s; training goes on", error)
        measured = record["measured_peak_bytes"]
        figures = {
            "plan/peak_gib": self.planned.peak_bytes / GiB,
            "plan/measured_peak_gib": None if measured is None else measured / GiB,
            "plan/peak_ratio": record["peak_ratio"],
            "plan/step_s": self.planned.step_s,
            "plan/measured_step_s": record["measured_step_s"],
            "plan/step_ratio": record["step_ratio"],
        }
        metrics = {key: float(value) for key, value in figures.items() if value is not None}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def measure(self, device: torch.device) -> dict[str, Any]:
        """The record: planned and measured peak memory and step time, their ratios, and how each was measured."""
        peak: int | None
        resident: int | None = None
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            how = "CUDA allocator's peak (max_memory_allocated)"
        else:
            peak = self._in_use_peak - self.planned.in_use_before
            resident = self._resident_peak - self.planned.in_use_before
            how = (
                "host memory in use (resident less glibc's free blocks) at forward and step ends, less before the "
                "weights loaded: a lower bound of the peak"
                if _mallinfo2() is not None
                else "resident memory at forward and step ends, less before the weights loaded (host; no glibc)"
            )
            if peak <= 0:  # an earlier stage of this process held more than this one uses: nothing to measure
                peak = None
                how = "not measurable: this process held more memory before the stage than during it (host)"
        steps = [b - a for a, b in zip(self._ends, self._ends[1:])][WARM_UP_STEPS - 1 :]
        step = statistics.median(steps) if steps else None
        planned = self.planned
        return {
            **asdict(planned),
            "measured_peak_bytes": peak,
            "memory_measured_as": how,
            # CPU: the resident peak, the freed blocks glibc keeps for reuse included (what the OS sees)
            "resident_peak_bytes": resident if resident and resident > 0 else None,
            "peak_ratio": peak / planned.peak_bytes if planned.peak_bytes and peak else None,
            "measured_step_s": step,
            "steps_timed": len(steps),
            "step_ratio": step / planned.step_s if step and planned.step_s else None,
        }
