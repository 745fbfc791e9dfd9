"""The loggers a stage writes to: Weights & Biases or CSV. ``make_logger`` picks the W&B mode (``logger.mode=auto``:
offline unless a key and the server are both there) and falls back online → offline → CSV, each step a warning, so
no W&B failure ever stops a run; a resumed job continues its W&B run. Also the run's final summary and model
artifacts, reopening a finished run (``recorded_run``), and a CSV logger that keeps a resumed run's history.
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
from lightning.pytorch.utilities import rank_zero_only

from models.errors import one_line
from models.files.folders import folder_record
from trainer.checkpoints import checkpoint_step
from trainer.config import LoggerConfig
from trainer.plots import read_csv_rows
from trainer.storage import is_global_rank_zero
from trainer.wandb_run import (
    LoggedSteps,
    check_log_model,
    exported_step,
    model_artifact,
    read_run_record,
    start_run_record,
)

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
    """A W&B logger whose failures are warnings: a full disk or a dropped connection never stops training.

    Lantern's own additions: rows an earlier start of the same run already logged are dropped (``LoggedSteps``:
    a resume replays the steps after its checkpoint), the last validation figures go into the summary as
    ``final/...`` when the run ends well, and ``log_model`` (off | final | all) logs ``final/`` and the checkpoints
    as model artifacts, whose failure is a warning that leaves the metrics logging on."""

    def __init__(
        self, *args: Any, run_dir: Path | None = None, record: dict[str, Any] | None = None,
        log_model: str = "off", **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)  # Lightning's own log_model (ModelCheckpoint's files) stays off
        # Lightning passes anonymous=None to wandb.init, and wandb >= 0.19 warns about the setting whatever its
        # value: a warning the user did not cause and cannot act on. Only an explicit value is passed on.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        self._run_dir = None if run_dir is None else Path(run_dir)
        self._steps = None if record is None or run_dir is None else LoggedSteps(Path(run_dir), record)
        self._models, self._final_figures, self._last_step = log_model, {}, None

    def _guard(self, action: str, function, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_lantern_broken", False):
            return None
        try:
            return function(*args, **kwargs)
        except Exception as error:
            self._lantern_broken = True
            warnings.warn(f"W&B {action} failed ({error!r}); W&B logging is off for the rest of this run")
            return None

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if step is not None and self._steps is not None:
            metrics = self._steps.new(metrics, step)  # not what an earlier start of this run logged
            if not metrics:
                return
        self._guard("log_metrics", super().log_metrics, metrics, step)
        if step is None or getattr(self, "_lantern_broken", False):
            return
        self._last_step = step
        self._final_figures.update(
            {
                k: v
                for k, v in metrics.items()
                if k.startswith(("val/", "eval/", "plan/")) and isinstance(v, int | float)
            }
        )
        if self._steps is not None:
            self._steps.logged(metrics, step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self._guard("log_hyperparams", super().log_hyperparams, params, *args, **kwargs)

    def log_table(self, *args: Any, **kwargs: Any) -> None:
        self._guard("log_table", super().log_table, *args, **kwargs)

    def log_image(self, *args: Any, **kwargs: Any) -> None:
        self._guard("log_image", super().log_image, *args, **kwargs)

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """``log_model=all``: each checkpoint trainer.storage.AtomicCheckpoint publishes, as it is published."""
        path = getattr(checkpoint_callback, "last_saved", None)
        if self._models == "all" and path is not None and self._experiment is not None:
            step = checkpoint_step(path)
            self._log_model_artifact(path, f"checkpoint-{self._experiment.id}", step, ["latest", f"step-{step}"])

    def _log_model_artifact(self, path: Path, name: str, step: int | None, aliases: list[str]) -> None:
        if getattr(self, "_lantern_broken", False) or self._experiment is None:
            return
        try:
            metadata = {"config": self._wandb_init.get("config") or {}}
            artifact = model_artifact(path, name=name, step=step, metadata=metadata)
            self._experiment.log_artifact(artifact, aliases=[a for a in aliases if a != "step-None"])
        except Exception as error:  # the model stays on disk; training and metrics logging go on
            warnings.warn(
                f"W&B could not log {path} as the model artifact {name} ({one_line(error)}); training goes on"
            )

    @rank_zero_only
    def _finish_well(self) -> None:
        """A run that ended well: its final validation figures in the summary (``final/val/loss``, ...), and
        ``final/`` as a model artifact when log_model asks for it."""
        if self._experiment is None or getattr(self, "_lantern_broken", False):
            return
        final = None if self._run_dir is None else self._run_dir / "final"
        step = exported_step(final) if final is not None and final.is_dir() else None
        step = self._last_step if step is None else step
        figures = {f"final/{key}": value for key, value in self._final_figures.items()}
        self._guard("summary", self._experiment.summary.update, {**figures, "final/step": step})
        if self._models in ("final", "all") and final is not None and final.is_dir():
            self._log_model_artifact(final, f"model-{self._experiment.id}", step, ["latest", "final", f"step-{step}"])

    def finalize(self, status: str) -> None:
        if status == "success":
            self._finish_well()
        self._guard("finalize", super().finalize, status)
        if status != "running":
            self._guard("finish", self.finish_run)

    def finish_run(self) -> None:
        import wandb  # deferred like every wandb import here: only runs that log to W&B pay for it

        # Close the run so the offline folder is complete when the process carries on (tests, pipelines). W&B's
        # service process writes the log's last records itself: on a loaded machine they were seen to land a
        # moment after finish() returned.
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


def make_logger(
    config: LoggerConfig,
    run_dir: Path,
    run_name: str,
    hyperparameters: dict[str, Any],
    *,
    resume: str | None = None,
) -> Logger | bool:
    """The stage's logger. W&B continues the run recorded in the run folder when training resumes from one of
    its checkpoints (``resume``, the checkpoint the trainer starts from), and starts a new run otherwise."""
    if config.kind == "none":
        return False
    if config.kind == "csv":
        return HistoryCSVLogger(save_dir=str(run_dir), name="csv", version="")
    log_model = check_log_model(config.log_model)
    os.environ.setdefault("WANDB_SILENT", "true")
    mode = wandb_mode(config)
    identity = {"project": config.project, "group": config.group, "job_type": job_type(config, run_dir)}
    record = None
    if is_global_rank_zero():  # the only rank that starts W&B, and the only one that writes its record
        record = start_run_record(run_dir, resuming=resumes_run(run_dir, resume), name=run_name, **identity)
    # wandb.init runs here (logger.experiment), not inside Lightning's setup, so that any W&B failure (a bad
    # project name, a refused key, an unreachable server) becomes one warning and the run goes on: offline
    # after a failed online start, else with the CSV logger.
    for attempt in [mode, "offline"] if mode == "online" else [mode]:
        try:
            with _ignored_wandb_mode_hidden():
                logger = SafeWandbLogger(
                    name=run_name,
                    save_dir=str(run_dir),
                    id=None if record is None else record["id"],  # Lightning passes resume="allow" with it
                    tags=list(config.tags),
                    mode=attempt,
                    config=hyperparameters,
                    settings=_wandb_settings(attempt, config.system_stats),
                    run_dir=run_dir,
                    record=record,
                    log_model=log_model,
                    **identity,
                )
                if is_global_rank_zero():  # other ranks log nothing (Lightning gives them a dummy experiment)
                    logger.experiment  # noqa: B018 - starts the W&B run now
            return logger
        except Exception as error:
            _finish_failed_wandb_run()
            fallback = "logging offline" if attempt == "online" else f"logging to CSV in {run_dir / 'csv'} instead"
            warnings.warn(f"cannot start W&B in {attempt} mode ({one_line(error)}); {fallback}", stacklevel=2)
    return HistoryCSVLogger(save_dir=str(run_dir), name="csv", version="")


def resumes_run(run_dir: Path, resume: str | None) -> bool:
    """Whether training continues this run folder's own run: it resumes from one of the folder's checkpoints."""
    if resume is None:
        return False
    checkpoints = (Path(run_dir) / "checkpoints").resolve()
    return Path(resume).resolve().parent == checkpoints


def job_type(config: LoggerConfig, run_dir: Path) -> str | None:
    """``logger.job_type``, else the stage the run folder was claimed for (its folder marker)."""
    return config.job_type or (folder_record(Path(run_dir)) or {}).get("stage")


@contextlib.contextmanager
def recorded_run(folder: Path, config: Any, **identity: Any) -> Iterator[Any | None]:
    """The W&B run recorded in ``folder`` (its wandb-run.json), open again for the summary or an artifact to be
    added, and finished on the way out; the pipeline's report reopens each stage's run this way, and its own
    (``identity``: project, group, job_type, name, recorded when ``folder`` holds no run of that group yet).
    ``config`` is read for ``mode`` and ``project``. Yields None, with a warning, when W&B cannot start: the
    numbers are in the report anyway. Offline, the reopening is one more folder under wandb/ with the same run
    id, which ``wandb sync`` uploads into the same run, after the ones before it."""
    record = read_run_record(folder)
    if identity and (record is None or record.get("group") != identity.get("group")):
        record = start_run_record(folder, resuming=False, **identity)
    if record is None:
        yield None
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    mode = wandb_mode(config)
    for attempt in [mode, "offline"] if mode == "online" else [mode]:
        try:
            import wandb  # deferred: see _wandb_settings

            with _ignored_wandb_mode_hidden():
                run = wandb.init(
                    project=record.get("project") or config.project, id=record["id"], resume="allow",
                    name=record.get("name"), group=record.get("group"), job_type=record.get("job_type"),
                    dir=str(folder), mode=attempt, settings=_wandb_settings(attempt, stats=False),
                )  # fmt: skip
        except Exception as error:
            _finish_failed_wandb_run()
            warnings.warn(f"cannot reopen the W&B run of {folder} in {attempt} mode ({one_line(error)})", stacklevel=3)
            continue
        try:
            yield run
        finally:
            try:
                run.finish()
            except Exception as error:
                warnings.warn(f"cannot close the W&B run of {folder} ({one_line(error)})", stacklevel=3)
        return
    yield None


def _finish_failed_wandb_run() -> None:
    try:
        import wandb  # deferred: see finish_run

        if wandb.run is not None:
            wandb.finish()
    except Exception:
        pass


def _wandb_settings(mode: str, stats: bool) -> Any:
    import wandb  # deferred: only runs that log to W&B pay for importing it

    # No console capture (Lantern's own log lines and metrics say it all). System stats: LoggerConfig.system_stats.
    timeout = {"init_timeout": WANDB_ONLINE_INIT_TIMEOUT_S} if mode == "online" else {}
    return wandb.Settings(console="off", x_disable_stats=not stats, silent=True, **timeout)


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
