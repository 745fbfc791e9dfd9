"""The loggers a stage writes to: Weights & Biases (offline unless a key and the server are both there) or CSV.

Owns: choosing the W&B mode (``logger.mode=auto``), starting W&B so that no failure of it ever stops a run
(online → offline → CSV, each step a warning), and the CSV logger that keeps a resumed run's history.
Does not own: what is logged (the LightningModules and trainer/callbacks.py) nor the plots (trainer/plots.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from models.errors import one_line
from trainer.config import LoggerConfig
from trainer.plots import read_csv_rows
from trainer.storage import is_global_rank_zero

log = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")
WANDB_ONLINE_INIT_TIMEOUT_S = 20  # W&B's own is 90 s plus retries: a run must not wait minutes for a dead server


def wandb_mode(config: LoggerConfig) -> str:
    """offline unless asked otherwise and an API key and the W&B server are both there."""
    variable = os.environ.get("WANDB_MODE")
    if variable and variable not in WANDB_MODES:  # make_logger hides it from W&B, which would refuse to start
        mode = "offline" if config.mode == "auto" else config.mode
        log.warning("WANDB_MODE=%r is not one of %s: ignored; logging %s", variable, ", ".join(WANDB_MODES), mode)
        return mode
    if config.mode != "auto":
        return config.mode
    if variable:
        return variable
    if not os.environ.get("WANDB_API_KEY"):
        return "offline"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or _wandb_base_url()).hostname or "api.wandb.ai"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        log.warning("W&B server %s unreachable: logging offline (sync later with `wandb sync`)", host)
        return "offline"
    return "online"


@contextlib.contextmanager
def _ignored_wandb_mode_hidden() -> Iterator[None]:
    """W&B reads WANDB_MODE itself when a run starts and refuses to start on a value it does not know, whatever
    mode it is given, so the offline run ``wandb_mode`` promised became the CSV fallback. A value Lantern ignores
    is hidden from W&B while its run starts (its service process, started then, never sees it) and put back after:
    the environment the user set is theirs."""
    variable = os.environ.get("WANDB_MODE")
    if not variable or variable in WANDB_MODES:
        yield
        return
    del os.environ["WANDB_MODE"]
    try:
        yield
    finally:
        os.environ["WANDB_MODE"] = variable


def _wandb_base_url() -> str:
    """The server the installed wandb talks to by default (it has changed between releases)."""
    try:
        import wandb  # deferred: only runs that log to W&B pay for importing it

        return str(wandb.Settings().base_url)
    except Exception:
        return "https://api.wandb.ai"


class SafeWandbLogger(WandbLogger):
    """A W&B logger whose failures are warnings: a full disk or a dropped connection never stops training."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Lightning passes anonymous=None to wandb.init, and wandb >= 0.19 warns about the setting whatever its
        # value: a warning the user did not cause and cannot act on. Only an explicit value is passed on.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

    def _guard(self, action: str, function, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_lantern_broken", False):
            return None
        try:
            return function(*args, **kwargs)
        except Exception as error:
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
            self._guard("finish", self.finish_run)

    def finish_run(self) -> None:
        import wandb  # deferred like every wandb import here: only runs that log to W&B pay for it

        # Close the run so the offline folder is complete when the process carries on (tests, pipelines). W&B's
        # service process writes the log's last records itself: on a loaded machine they were seen to land a
        # moment after finish() returned (tests/alignment/test_pretrain_run.py waits for them).
        if self._experiment is not None and wandb.run is not None:
            wandb.finish()


class _HistoryWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv when it starts, so a resumed run would lose the
    history before the resume. This one reads the old rows first and writes them back ahead of the new ones,
    keeping only rows older than the first step logged after the resume (replayed steps are counted once)."""

    def __init__(self, log_dir: str) -> None:
        path = Path(log_dir) / self.NAME_METRICS_FILE
        self.previous_rows = read_csv_rows(path) if path.is_file() else []
        with warnings.catch_warnings():  # its "previous log files will be deleted" is not true here
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            super().__init__(log_dir=log_dir)

    def save(self) -> None:
        if self.previous_rows and self.metrics:
            first_new_step = min(int(row["step"]) for row in self.metrics)
            kept = [row for row in self.previous_rows if _step_of(row) is not None and _step_of(row) < first_new_step]
            self.metrics = [*kept, *self.metrics]
            self.previous_rows = []
        super().save()


def _step_of(row: dict[str, Any]) -> int | None:
    try:
        return int(float(row["step"]))
    except (KeyError, TypeError, ValueError):
        return None


class HistoryCSVLogger(CSVLogger):
    """``logger.kind=csv``: Lightning's CSVLogger, but a resumed run keeps the metrics logged before it."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _HistoryWriter(log_dir=self.log_dir)
        return self._experiment


def make_logger(config: LoggerConfig, run_dir: Path, run_name: str, hyperparameters: dict[str, Any]) -> Logger | bool:
    if config.kind == "none":
        return False
    if config.kind == "csv":
        return HistoryCSVLogger(save_dir=str(run_dir), name="csv", version="")
    os.environ.setdefault("WANDB_SILENT", "true")
    mode = wandb_mode(config)
    # wandb.init runs here (logger.experiment), not inside Lightning's setup, so that any W&B failure (a bad
    # project name, a refused key, an unreachable server) becomes one warning and the run goes on: offline
    # after a failed online start, else with the CSV logger.
    for attempt in [mode, "offline"] if mode == "online" else [mode]:
        try:
            with _ignored_wandb_mode_hidden():
                logger = SafeWandbLogger(
                    project=config.project,
                    name=run_name,
                    save_dir=str(run_dir),
                    group=config.group,
                    tags=list(config.tags),
                    mode=attempt,
                    config=hyperparameters,
                    settings=_wandb_settings(attempt),
                )
                if is_global_rank_zero():  # other ranks log nothing (Lightning gives them a dummy experiment)
                    logger.experiment  # noqa: B018 - starts the W&B run now
            return logger
        except Exception as error:
            _finish_failed_wandb_run()
            fallback = "logging offline" if attempt == "online" else f"logging to CSV in {run_dir / 'csv'} instead"
            warnings.warn(f"cannot start W&B in {attempt} mode ({one_line(error)}); {fallback}", stacklevel=2)
    return HistoryCSVLogger(save_dir=str(run_dir), name="csv", version="")


def _finish_failed_wandb_run() -> None:
    try:
        import wandb  # deferred: see finish_run

        if wandb.run is not None:
            wandb.finish()
    except Exception:
        pass


def _wandb_settings(mode: str) -> Any:
    import wandb  # deferred: only runs that log to W&B pay for importing it

    # No console capture and no system-stats thread: fewer moving parts in offline CPU runs.
    timeout = {"init_timeout": WANDB_ONLINE_INIT_TIMEOUT_S} if mode == "online" else {}
    return wandb.Settings(console="off", x_disable_stats=True, silent=True, **timeout)


def close_logger(logger: Logger | bool) -> None:
    """End the W&B run a stage started, however the stage ended: a run left open in this process would be
    taken over by the next stage (a pipeline, a test session). A no-op once Lightning has finalized it; a
    failure is a warning, never an error on top of the one being raised."""
    if not isinstance(logger, SafeWandbLogger):
        return
    try:
        logger.finish_run()
    except Exception as error:
        warnings.warn(f"cannot close the W&B run ({one_line(error)})")
