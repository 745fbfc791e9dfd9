"""Every command's destination holds only what Lantern wrote there: what it did not write is refused in one line,
never replaced nor deleted.

- ``lantern prepare``: a source under ``data.out_dir``, a user's file in ``train/`` or ``val/``, a ``manifest.json``
  Lantern did not write; stale ``.prepare-*`` build folders (only Lantern's are removed); two prepares into one
  folder (the second is refused while the first runs); a full disk names the path, not the input.
- run folders: a folder holding a user's ``config.yaml``, ``metrics.csv``, ``loss.png``, ``csv/metrics.csv`` or
  ``checkpoints/latest`` is refused before any compute; ``run.name`` must stay inside ``run.out_dir``.
- ``lantern demo-data --out`` over a user's files, ``lantern tokenizer train --out`` over an unrelated file, and a
  pipeline ``out_dir`` holding a user's files.
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import data.pretrain.prepare
from alignment.commands.cli import main as lantern
from alignment.commands.pipeline import Pipeline, PipelineConfig
from alignment.stages.pretrain import run_pretrain
from data.demo.tasks import write_demo_dataset
from data.pretrain.config import PrepareConfig
from data.pretrain.datamodule import PretrainDataModule
from data.pretrain.manifest import read_manifest
from data.pretrain.prepare import prepare
from data.tokenizer.bpe import check_output_file
from models.errors import ConfigError, DataError
from models.files.atomic import StorageError, close_lock
from models.files.folders import FOLDER_MARKER, LOCK_FILE, FolderInUse, FolderNotLanterns, lock_out_readers
from tests.alignment.test_pretrain_run import RUN_NAME, tiny_config
from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
QUICK = ("trainer.max_steps=2", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=2", "logger.kind=none")
SMALL_CORPUS = "".join(f"Paragraph {i} of a small corpus, with some words in it.\n\n" for i in range(200))


def small_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.txt"
    path.write_text(SMALL_CORPUS)
    return path


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but the lock file (which names its latest holder)."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_FILE)
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


# --------------------------------------------------------------------------------------------------
# lantern prepare


def test_prepare_never_deletes_a_source_under_its_out_dir(tmp_path, capsys):
    """Before: the source corpus at out_dir/train/corpus.txt was moved into the build folder and deleted (exit 0)."""
    out = tmp_path / "x"
    source = small_corpus(out / "train")
    status = lantern(
        ["prepare", str(ROOT / "configs/pretrain/tiny.yaml"), f"data.source=[{source}]", f"data.out_dir={out}"]
    )
    assert status == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("lantern prepare: error: data.out_dir") and f"contains the source {source}" in error
    assert "\n" not in error
    assert source.read_text() == SMALL_CORPUS
    assert sorted(p.name for p in out.iterdir()) == ["train"]


@pytest.mark.parametrize("user_file", ["train/my_data.parquet", "val/my_val.jsonl", "notes.txt"])
def test_prepare_refuses_a_folder_holding_files_it_did_not_write(tmp_path, user_file):
    """Before: a user's train/ or val/ was moved into the build folder and removed, the manifest overwritten."""
    out = tmp_path / "data"
    (out / user_file).parent.mkdir(parents=True, exist_ok=True)
    (out / user_file).write_text("the user's")
    before = contents(out)
    with pytest.raises(
        FolderNotLanterns, match=rf"^data\.out_dir: refusing to write into {out}: .*{Path(user_file).parts[0]}"
    ):
        prepare(PrepareConfig(source=[str(small_corpus(tmp_path / "src"))], out_dir=str(out)))
    assert contents(out) == before


def test_a_rebuild_replaces_only_what_a_prepare_wrote(tmp_path):
    """A folder Lantern prepared is rebuilt when its settings change, but a file a user put into its splits (or a
    manifest.json of theirs) stops the rebuild in one line naming it, and nothing changes."""
    source, out = small_corpus(tmp_path / "src"), tmp_path / "data"
    first = prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.1))
    (out / "val" / "my_val.jsonl").write_text("the user's")
    before = contents(out)
    with pytest.raises(FolderNotLanterns, match=r"refusing to rebuild .*\(val/my_val\.jsonl\)"):
        prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))
    assert contents(out) == before
    (out / "val" / "my_val.jsonl").unlink()
    second = prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))
    assert second["splits"]["val"]["documents"] > first["splits"]["val"]["documents"]

    (out / "manifest.json").write_text(json.dumps({"my": "manifest"}))
    with pytest.raises(FolderNotLanterns, match=r"refusing to rebuild .*\(manifest\.json\)"):
        prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.1))
    assert json.loads((out / "manifest.json").read_text()) == {"my": "manifest"}


def test_data_prepared_before_folder_markers_is_adopted_and_rebuilt(tmp_path):
    """A folder an older Lantern prepared (no marker, no split listings: its manifest names the shards) is still
    Lantern's: a rebuild replaces it."""
    source, out = small_corpus(tmp_path / "src"), tmp_path / "data"
    prepare(PrepareConfig(source=[str(source)], out_dir=str(out)))
    for leftover in (out / FOLDER_MARKER, out / "train" / ".lantern-split.json", out / "val" / ".lantern-split.json"):
        leftover.unlink()
    manifest = prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))
    assert read_manifest(out) == manifest and (out / FOLDER_MARKER).is_file()


def test_only_build_folders_a_prepare_made_are_cleaned_up(tmp_path):
    source, out = small_corpus(tmp_path / "src"), tmp_path / "data"
    prepare(PrepareConfig(source=[str(source)], out_dir=str(out)))
    dead = 2**22 + 12345  # no such process
    theirs = out / f".prepare-{dead}-user"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("the user's")
    ours = out / f".prepare-{dead}-abcdef12"
    shutil.copytree(out / "train", ours / "train")
    (ours / FOLDER_MARKER).write_text(json.dumps({"kind": "prepare build"}))
    prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))  # a rebuild cleans up
    assert not ours.exists()
    assert (theirs / "keep.txt").read_text() == "the user's"


HOLDER = """
import sys, time
from pathlib import Path
from models.files.folders import lock_folder
lock_folder(Path(sys.argv[1]), what="data folder", hint="wait")
print("locked", flush=True)
time.sleep(300)
"""


@contextmanager
def process_holding(script: str, folder: Path, ready: str) -> Iterator[subprocess.Popen]:
    """Another process running ``script`` on ``folder`` from the moment it prints ``ready``; SIGKILLed at the end."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(folder)], cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == ready
        yield process
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)


def test_a_second_prepare_into_one_folder_is_refused_while_the_first_runs(tmp_path):
    """Before: two prepares into one folder both reported success with different counts; the last writer won."""
    source, out = small_corpus(tmp_path / "src"), tmp_path / "data"
    prepare(PrepareConfig(source=[str(source)], out_dir=str(out)))
    before = contents(out)
    with process_holding(HOLDER, out, "locked") as holder:
        with pytest.raises(FolderInUse, match=rf"data folder {out} is in use by process {holder.pid}"):
            prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))
        assert contents(out) == before
    prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))  # a dead holder never blocks


READER = """
import sys, time
from data.pretrain.datamodule import PretrainDataModule
PretrainDataModule(sys.argv[1], seq_len=8, micro_batch_size=2).setup("fit")
print("reading", flush=True)
time.sleep(300)
"""


def test_prepare_refuses_to_rebuild_data_a_run_is_reading(tmp_path):
    """Before: `lantern prepare` replaced the data under a live pretraining run without a word. A rebuild is
    refused naming the reading process; an up-to-date prepare still passes; and a run does not start on data a
    rebuild is replacing."""
    source, out = small_corpus(tmp_path / "src"), tmp_path / "data"
    prepare(PrepareConfig(source=[str(source)], out_dir=str(out)))
    before = contents(out)
    with process_holding(READER, out, "reading") as reader:
        prepare(PrepareConfig(source=[str(source)], out_dir=str(out)))  # up to date: nothing to replace
        message = rf"data folder {out} is being read by a training run \(process {reader.pid}\): let it finish"
        with pytest.raises(FolderInUse, match=message):
            prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))
        assert contents(out) == before
    rebuild = lock_out_readers(out, what="data folder", hint="")  # what a prepare holds while it rebuilds
    try:
        with pytest.raises(FolderInUse, match=rf"data folder {out} is being rebuilt by `lantern prepare`"):
            PretrainDataModule(str(out), seq_len=8, micro_batch_size=2).setup("fit")
    finally:
        close_lock(rebuild)
    prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))  # a run that ended never blocks
    assert read_manifest(out)["settings"]["val_fraction"] == 0.2


@pytest.mark.parametrize("where", ["datasets-cache", "shards"])
def test_a_full_disk_during_prepare_names_the_path_not_the_input(tmp_path, monkeypatch, where):
    """Before: a full disk under `datasets`' cache read "cannot read the text input: OSError ..." with no path."""
    source, out = small_corpus(tmp_path / "src"), tmp_path / "data"
    prepare(PrepareConfig(source=[str(source)], out_dir=str(out)))
    before = contents(out)
    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "datasets-cache":

        def load_source(*args, **kwargs):
            raise ValueError(f"cannot read the text input: OSError: {full}") from full

        monkeypatch.setattr(data.pretrain.prepare, "load_source", load_source)
    else:

        def write_splits(tokens, config, dtype, build_dir):
            raise OSError(errno.ENOSPC, "No space left on device", str(build_dir / "train" / "shard-00000.bin"))

        monkeypatch.setattr(data.pretrain.prepare, "_write_splits", write_splits)
    with pytest.raises(StorageError) as caught:
        prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.2))
    message = str(caught.value)
    assert message.startswith(f"cannot write prepared data {out}") and "no space left on device" in message
    assert "the data there before is unchanged" in message and "input" not in message
    assert contents(out) == before and not list(out.glob(".prepare-*"))


# --------------------------------------------------------------------------------------------------
# run folders


@pytest.mark.parametrize(
    "user_file", ["config.yaml", "metrics.csv", "loss.png", "csv/metrics.csv", "checkpoints/latest"]
)
def test_a_run_folder_lantern_did_not_make_is_refused_unless_empty(data_dir, tmp_path, user_file):
    """Before: pointing run.name at a folder holding these replaced all five."""
    run_dir = tmp_path / "runs" / RUN_NAME
    (run_dir / user_file).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / user_file).write_text("the user's")
    with pytest.raises(FolderNotLanterns, match=rf"^run\.name: refusing to write into {run_dir}: it holds files"):
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK))
    assert contents(run_dir) == {user_file: b"the user's"}


def test_an_empty_run_folder_is_taken_and_a_lantern_run_folder_is_reused(data_dir, tmp_path):
    run_dir = tmp_path / "runs" / RUN_NAME
    run_dir.mkdir(parents=True)
    run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK))
    assert json.loads((run_dir / FOLDER_MARKER).read_text())["stage"] == "pretrain"
    (run_dir / "notes.txt").write_text("the user's, in a folder Lantern made")  # left alone, not refused
    run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK, "trainer.max_steps=4"))
    assert (run_dir / "notes.txt").read_text() == "the user's, in a folder Lantern made"


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/../../x", "/tmp/elsewhere"])
def test_run_name_must_stay_inside_run_out_dir(data_dir, tmp_path, name):
    """Before: these were accepted, and the run folder landed outside run.out_dir (or was run.out_dir itself)."""
    with pytest.raises(ConfigError, match=r"^run\.name must name a folder inside run\.out_dir"):
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK, f"run.name='{name}'"))
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------------
# demo data, tokenizer files, pipelines


def test_demo_data_refuses_a_folder_holding_the_users_files(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "train.jsonl").write_text('{"prompt": "mine", "response": "mine"}\n')
    (out / "pairs.jsonl").write_text("")
    before = contents(out)
    assert lantern(["demo-data", "--out", str(out), "--n-train", "5", "--n-val", "5", "--n-pairs", "5"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"lantern demo-data: error: --out: refusing to write into {out}: it holds files Lantern did not write "
        "(pairs.jsonl, train.jsonl); move them away or set --out to an empty or new folder"
    )
    assert contents(out) == before
    paths = write_demo_dataset(tmp_path / "demo", n_train=5, n_val=5, n_pairs=5)  # a new folder: written,
    write_demo_dataset(tmp_path / "demo", n_train=6, n_val=5, n_pairs=5)  # and rewritten, as Lantern's
    assert len(paths["train"].read_text().splitlines()) == 6


def test_tokenizer_train_refuses_to_replace_an_unrelated_file(tmp_path):
    mine = tmp_path / "notes.tiktoken"
    mine.write_text("the user's notes\n")
    with pytest.raises(DataError, match=r"^--out .*notes\.tiktoken exists and is not a tokenizer trained by"):
        check_output_file(mine, flag="--out")
    assert mine.read_text() == "the user's notes\n"
    check_output_file(ROOT / "data" / "assets" / "shakespeare-4096.tiktoken", flag="--out")  # Lantern's: replaceable


def test_a_pipeline_refuses_an_out_dir_holding_the_users_files(tmp_path):
    out = tmp_path / "pipe"
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "thesis.tex").write_text("the user's")
    with pytest.raises(FolderNotLanterns, match=rf"^out_dir: refusing to write into {out}: .*\(sft\)"):
        Pipeline(PipelineConfig(out_dir=str(out), stages=["prepare"])).run()
    assert contents(out) == {"sft/thesis.tex": b"the user's"}


def test_a_read_only_prepared_folder_is_read_when_up_to_date_and_named_when_not(tmp_path, monkeypatch):
    """Before: `lantern prepare` of a shared, read-only, up-to-date folder failed on `Permission denied:
    .lantern.lock`. Root writes through any mode, so taking the lock fails here as it does for another user."""
    import data.pretrain.prepare as prepare_module

    source, out = small_corpus(tmp_path / "src"), tmp_path / "data"
    manifest = prepare(PrepareConfig(source=[str(source)], out_dir=str(out)))

    def read_only(folder, **kwargs):
        raise PermissionError(13, "Permission denied", str(folder / LOCK_FILE))

    monkeypatch.setattr(prepare_module, "lock_folder", read_only)
    assert prepare(PrepareConfig(source=[str(source)], out_dir=str(out))) == manifest
    with pytest.raises(StorageError, match=rf"data folder {out} is read-only here \(Permission denied\) and its data "):
        prepare(PrepareConfig(source=[str(source)], out_dir=str(out), val_fraction=0.3))
