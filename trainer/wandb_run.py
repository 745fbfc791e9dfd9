"""One W&B run per job across its resumes: ``wandb-run.json`` in the run folder (the run id, project, group, job type,
and the last ``trainer/global_step`` logged with the names logged at it). The id is kept when training resumes from
a checkpoint of this folder and made anew for anything that starts from step 0; ``LoggedSteps`` drops what an
earlier start already logged, so a resume's replayed steps never repeat on the curve. Written by global rank 0
without fsync (one stale step costs at most a step logged twice). No torch and no wandb at import.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.files.atomic import write_atomically

RUN_RECORD = "wandb-run.json"
LOG_MODEL = ("off", "final", "all")


def read_run_record(run_dir: Path) -> dict[str, Any] | None:
    """The run folder's W&B record, or None when there is none (or it does not read as one)."""
    try:
        record = json.loads((Path(run_dir) / RUN_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("id"), str) and record["id"] else None


def write_run_record(run_dir: Path, record: Mapping[str, Any]) -> None:
    """Replace the record by write-then-rename (a reader never sees half of it); no fsync (see the module notes)."""
    payload = json.dumps(dict(record), indent=1) + "\n"
    write_atomically(Path(run_dir) / RUN_RECORD, payload, what="W&B run record", durable=False)


def new_run_id() -> str:
    """A W&B run id: wandb's own generator (8 characters of [a-z0-9]) when wandb imports, else the same shape."""
    try:
        from wandb.util import generate_id  # deferred: only runs that log to W&B import wandb

        return str(generate_id())
    except Exception:
        return uuid.uuid4().hex[:8]


def start_run_record(run_dir: Path, *, resuming: bool, **identity: Any) -> dict[str, Any]:
    """The record this start of the run logs under, written to the run folder: the recorded id and logged steps
    when training resumes from a checkpoint of this folder, else a new id that has logged nothing. ``identity``
    (project, group, job_type, name) is recorded for whoever reopens the run later (the pipeline's report)."""
    previous = read_run_record(run_dir) if resuming else None
    record = {"id": new_run_id(), "step": -1, "keys": []} if previous is None else previous
    record.update(identity)
    write_run_record(run_dir, record)
    return record


class LoggedSteps:
    """Which rows this run already holds, so that nothing is logged twice: a step below the last one logged is
    dropped whole (an earlier start of the run logged everything at it), and at the last step only the names not
    yet logged there pass (a kill can land between a step's training and validation rows)."""

    def __init__(self, run_dir: Path, record: dict[str, Any]) -> None:
        self.run_dir, self.record = Path(run_dir), record
        self.step, self.keys = int(record.get("step", -1)), set(record.get("keys") or ())

    def new(self, metrics: Mapping[str, Any], step: int) -> dict[str, Any]:
        """The part of ``metrics`` (to be logged at ``step``) the run does not hold yet."""
        if step < self.step:
            return {}
        return dict(metrics) if step > self.step else {k: v for k, v in metrics.items() if k not in self.keys}

    def logged(self, metrics: Mapping[str, Any], step: int) -> None:
        if step > self.step:
            self.step, self.keys = step, set()
        self.keys.update(metrics)
        self.record.update(step=self.step, keys=sorted(self.keys))
        # the row is logged; a record left stale by a full disk costs at most replayed rows after a resume
        with contextlib.suppress(OSError):
            write_run_record(self.run_dir, self.record)


def check_log_model(value: Any) -> str:
    """``logger.log_model`` as one of off | final | all (YAML's false / true: off / final); anything else is a
    ConfigError naming the key."""
    from models.errors import ConfigError  # deferred: the record above stays importable on its own

    resolved = {False: "off", True: "final"}.get(value, value) if isinstance(value, bool) else value
    if resolved not in LOG_MODEL:
        raise ConfigError(f"logger.log_model must be one of {', '.join(LOG_MODEL)} (or false / true), got {value!r}")
    return resolved


def model_artifact(path: Path, *, name: str, step: int | None, metadata: Mapping[str, Any]) -> Any:
    """A W&B artifact of type ``model`` holding ``path`` (a checkpoint file or folder, with its checksum manifest
    when there is one, or an exported model folder), with the step and ``metadata`` (the run's config)."""
    import wandb  # deferred: see new_run_id

    artifact = wandb.Artifact(name, type="model", metadata={"step": step, **metadata})
    if path.is_dir():
        artifact.add_dir(str(path), name=path.name)
    else:
        artifact.add_file(str(path), name=path.name)
    manifest = path.with_name(path.name + ".sha256")
    if manifest.is_file():
        artifact.add_file(str(manifest), name=manifest.name)
    return artifact


def exported_step(final: Path) -> int | None:
    """The step an exported model folder was written at (its lantern.json metadata), if it says."""
    try:
        step = json.loads((final / "lantern.json").read_text(encoding="utf-8"))["metadata"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None
