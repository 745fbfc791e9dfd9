"""What a pipeline run leaves in each stage's folder so the next run is incremental, and the hashes it compares.

A stage that starts writes ``pipeline_stage.pending.json`` (``PENDING``) with the hash it runs with; a finished
one writes ``pipeline_stage.json`` (``RECORD``): the hash of its fully resolved config and of its inputs' hashes.
``stage_state`` reads them back for a stage about to run: up to date (skip it), interrupted with the same hash
(resume it), or neither (train it from scratch). Inputs are identified cheaply: prepared data by its manifest, a
checkpoint folder from outside the pipeline by its files' names, sizes and mtimes (``models.files.digests.folder_fingerprint``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from models.files.digests import content_key
from trainer.storage import claim_run_directory, lock_run_directory, release_run_directory

RECORD, PENDING = "pipeline_stage.json", "pipeline_stage.pending.json"
StageState = Literal["up to date", "interrupted", "new"]


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def data_hash(manifest: dict[str, Any]) -> str:
    return content_key(manifest)  # the manifest names inputs (sha256), tokenizer, settings


def write_record(folder: Path, record: dict[str, Any], name: str = RECORD) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".tmp-{name}"
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    temporary.replace(folder / name)  # atomic: a crash leaves the old record or the new one


def stage_state(run_dir: Path, digest: str) -> StageState:
    """What ``run_dir`` says about a model stage that would run with hash ``digest``: finished with it and its
    ``final/`` model there (up to date), started with it and never finished (interrupted), or neither (new)."""
    record, pending = read_json(run_dir / RECORD), read_json(run_dir / PENDING)
    if record and record["hash"] == digest and (run_dir / "final").is_dir():
        return "up to date"
    if record is None and pending and pending["hash"] == digest:
        return "interrupted"
    return "new"


def older_pipeline(root: Path) -> bool:
    """A pipeline folder written before folder markers: it holds the records only a pipeline writes."""
    records = (root / "data" / "demo" / "demo_manifest.json", root / "data" / "corpus" / "manifest.json")
    return any(path.is_file() for path in records) or any(root.glob(f"*/{RECORD}"))


def move_aside(run_dir: Path, stage: str) -> Path:
    """Move the stage's old run to STAGE.previous, else STAGE.previous-2, -3, ... (the first name free) and return
    where. Earlier runs are kept, never deleted: a finished one holds checkpoints and a final model only the user may
    decide to remove. Refused (FolderInUse, naming the process) while a run is live in it, and for a folder that is
    not this stage's Lantern run."""
    claim_run_directory(run_dir, stage)
    lock_run_directory(run_dir)  # a `lantern STAGE` started by hand may be training there
    try:
        backup, number = run_dir.with_name(f"{run_dir.name}.previous"), 1
        while backup.exists():
            number += 1
            backup = run_dir.with_name(f"{run_dir.name}.previous-{number}")
        run_dir.rename(backup)
    finally:
        release_run_directory(run_dir)  # the lock is held under the name it was taken by (the fd moved with it)
    return backup
