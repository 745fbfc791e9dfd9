"""Stopping a multi-process run on SIGTERM: every rank at one optimizer step, saved, and every process ended with
143 within a grace period, main last (``StopTogether``, mixed into the FSDP2 and DDP strategies).

Lightning 2.6's own handling hangs such a run: its SIGTERM handler broadcasts from inside the handler on the rank that
got the signal (a collective no other rank matches), each rank stops at the end of its own batch, and its watch over
the child ranks SIGKILLs the main process when a child exits 143. This replaces its signal connector, launcher and
watch (private Lightning attributes: there is no public way in; check them on a Lightning upgrade).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from trainer import interrupts

# SLURM's KillWait and Kubernetes' grace period are 30 s unless set: a stop that cannot finish ends before their SIGKILL
STOP_GRACE_S = 25.0


class _StopTogether(_SignalConnector):
    """Lightning's signal handling, SIGTERM made safe under several processes. Lightning's handler broadcasts from
    inside the handler, on the rank that got the signal: a collective no other rank matches (all hang until the
    collective timeout), and each rank stops at the end of its own batch. Here the handler only notes it; after each
    optimizer step the ranks all-reduce the note (``agree``) and, if any has one, all see ``received_sigterm``:
    Lightning stops them at the end of that step (after its validation) and AtomicCheckpoint saves it."""

    def __init__(self, trainer: L.Trainer, strategy: StopTogether) -> None:
        self.agreed = False
        super().__init__(trainer)
        self.strategy, self.noted = strategy, False  # noted: this process received a SIGTERM
        self._unwatch: Callable[[], None] = lambda: None
        # agreed on the host, never by a device read (on a GPU, a wait for every queued kernel): a gloo group of its
        # own beside NCCL's (made here, on every rank alike: strategies set up on all)
        self.group = dist.new_group(backend="gloo", timeout=getattr(strategy, "_timeout", None))

    @property
    def received_sigterm(self) -> bool:  # what Lightning's loops stop on
        return self.agreed and not self.trainer.validating

    @received_sigterm.setter
    def received_sigterm(self, value: bool) -> None:  # Lightning resets it when it installs its handlers
        self.agreed = value

    def register_signal_handlers(self) -> None:
        super().register_signal_handlers()
        self._unwatch = interrupts.watch_delivery(self.strategy.stop_grace_s, self.last_words)

    def teardown(self) -> None:
        super().teardown()
        self._unwatch()
        if self.group is not None and dist.is_initialized():  # a local act: the ranks are past their last step
            dist.destroy_process_group(self.group)
        self.group = None

    def _sigterm_notifier_fn(self, signum: Any, frame: Any) -> None:
        self.noted = True
        interrupts.end_within(self.strategy.stop_grace_s, self.last_words)  # armed already unless off the main thread

    def agree(self) -> None:
        """Every rank, after every optimizer step: whether any rank received a SIGTERM (a scalar's all-reduce)."""
        flag = torch.tensor([float(self.noted)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() > 0 and not self.agreed:
            self.agreed = True
            interrupts.note_signal(signal.SIGTERM)  # this rank too ends as a SIGTERM's (143), and in bounded time
            interrupts.end_within(self.strategy.stop_grace_s, self.last_words)

    def last_words(self) -> str:
        """At the deadline (on its thread): the child ranks are killed; rank 0 names the last checkpoint."""
        if isinstance(self.strategy.launcher, _Launcher):
            self.strategy.launcher.end_children(until=0.0)
        folders = [callback.directory for callback in self.trainer.callbacks if hasattr(callback, "last_saved")]
        note = interrupts.checkpoint_note(folders[0]) if folders else "this run keeps no checkpoint"
        return "" if self.trainer.global_rank else (
            f"ERROR trainer.parallel: SIGTERM: the ranks did not all reach an optimizer step within "
            f"{self.strategy.stop_grace_s:g}s of it (a rank hung, or a step or save longer than that): stopped "
            f"without saving; {note}"
        )  # fmt: skip


class _Watch(_ChildProcessObserver):
    """Lightning's watch over the child ranks (one exiting non-zero SIGKILLs all, the main process too), standing
    down once the run is stopping: a child's 143 is the stop, and the main process ends its children itself."""

    def __init__(self, main_pid: int, child_processes: list[subprocess.Popen], stopping: threading.Event) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes)
        self.stopping = stopping

    def _run(self) -> bool:
        stopped = any(proc.poll() == 128 + signal.SIGTERM for proc in self._child_processes)
        return self.stopping.is_set() or stopped or super()._run()


class _Launcher(_SubprocessScriptLauncher):
    """Lightning's launcher of the other local ranks, its watch being ``_Watch``."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.stopping = threading.Event()

    def launch(self, function: Callable, *args: Any, trainer: L.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:  # Lightning's own launch, with _Watch
            self._call_children_scripts()
            _Watch(os.getpid(), self.procs, self.stopping).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def end_children(self, *, until: float, signum: int | None = None) -> None:
        self.stopping.set()
        interrupts.end_children(self.procs, until=until, signum=signum)


class StopTogether:
    """For a strategy whose ranks Lightning launches (mixed in before it): a SIGTERM to any process stops all ranks at
    one optimizer step, saved, and every process ends with 143 within ``stop_grace_s`` (saved or not), main last."""

    _stop: _StopTogether | None = None

    def __init__(self, *args: Any, stop_grace_s: float = STOP_GRACE_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_grace_s = stop_grace_s

    @property
    def stop_agreed(self) -> bool:
        """Whether every rank is stopping at this optimizer step on a SIGTERM (AtomicCheckpoint then saves it)."""
        return self._stop is not None and self._stop.agreed

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
            self._launcher = _Launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if trainer.world_size > 1:  # before trainer.fit installs its handlers; a private attribute, the only way in
            self._stop = trainer._signal_connector = _StopTogether(trainer, self)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._stop is not None:
            self._stop.agree()
        return result

    def teardown(self) -> None:
        super().teardown()
        interrupted = self._stop is None or self._stop.trainer.interrupted  # not a run that finished after a SIGTERM
        if isinstance(self._launcher, _Launcher) and interrupted and interrupts.received_signal() == signal.SIGTERM:
            # the ranks stop by themselves when they agreed with this one; else they hear of it now (before training
            # they may be waiting in a collective for this process: killed at the deadline)
            until = interrupts.deadline() or time.monotonic() + self.stop_grace_s
            self._launcher.end_children(until=until, signum=None if self.stop_agreed else signal.SIGTERM)


class StoppingDDPStrategy(StopTogether, DDPStrategy):
    """Lightning's DDP with ``StopTogether``."""
