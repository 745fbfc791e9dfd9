"""Two pipelines in one folder, and the runs a pipeline replaces: a second `lantern pipeline` into a folder a live
pipeline holds is refused naming its process, before it writes anything (before: it moved the live `pretrain/` to
`pretrain.previous`, exited 0, and the first run died writing into the second's folder); a stage folder with a live
run in it is never moved; and an earlier run is kept under a numbered name, never deleted (before: a finished run
in `STAGE.previous` was deleted, checkpoints and final model, with only "moved the old run" in the log)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from alignment.commands.pipeline import run_pipeline
from alignment.commands.pipeline_records import move_aside
from models.files.folders import LOCK_FILE, FolderInUse
from tests.helpers import subprocess_env
from trainer.storage import claim_run_directory

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pipeline/tiny.yaml")

HOLDER = """
import sys, time
from pathlib import Path
from models.files.folders import claim_folder, lock_folder
from trainer.storage import claim_run_directory, lock_run_directory
folder, kind = Path(sys.argv[1]), sys.argv[2]
if kind == "pipeline":
    claim_folder(folder, "pipeline", key="out_dir")
    lock_folder(folder, what="pipeline folder", hint="wait")
else:
    claim_run_directory(folder, kind)
    lock_run_directory(folder)
print("locked", flush=True)
time.sleep(300)
"""


def held(folder: Path, kind: str) -> subprocess.Popen:
    """A process holding ``folder`` as a live pipeline (``kind`` "pipeline") or a live run of stage ``kind``."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), kind], cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    return holder


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.name != LOCK_FILE}


def test_a_second_pipeline_into_a_live_pipelines_folder_is_refused_before_it_writes(tmp_path):
    out = tmp_path / "P"
    holder = held(out, "pipeline")
    try:
        before = files(out)
        with pytest.raises(FolderInUse, match=rf"pipeline folder {out} is in use by process {holder.pid} "):
            run_pipeline(TINY, [f"out_dir={out}"])
        assert files(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)


def finished_run(folder: Path, stage: str, marker: str) -> None:
    claim_run_directory(folder, stage)
    (folder / "final").mkdir()
    (folder / "final" / "model.safetensors").write_text(marker)


def test_a_stage_folder_with_a_live_run_is_never_moved(tmp_path):
    run_dir = tmp_path / "P" / "sft"
    run_dir.mkdir(parents=True)
    holder = held(run_dir, "sft")
    try:
        with pytest.raises(FolderInUse, match=rf"run folder {run_dir} is in use by process {holder.pid} "):
            move_aside(run_dir, "sft")
        assert run_dir.is_dir() and not (tmp_path / "P" / "sft.previous").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)


def test_earlier_runs_are_kept_under_numbered_names_never_deleted(tmp_path):
    root = tmp_path / "P"
    for name, marker in (("sft.previous", "first"), ("sft", "second")):
        (root / name).mkdir(parents=True)
        finished_run(root / name, "sft", marker)
    assert move_aside(root / "sft", "sft") == root / "sft.previous-2"
    (root / "sft").mkdir()
    finished_run(root / "sft", "sft", "third")
    assert move_aside(root / "sft", "sft") == root / "sft.previous-3"
    kept = {p.parent.parent.name: p.read_text() for p in root.glob("*/final/model.safetensors")}
    assert kept == {"sft.previous": "first", "sft.previous-2": "second", "sft.previous-3": "third"}
