"""Nothing Lantern did not write is deleted, and storage failures are one clear line with nothing lost:
convert/export destinations, the final/ folder, the run-folder lock, a full or read-only disk (simulated by
patching the writers: the tests run as root, which chmod does not stop).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import models.files.atomic
from alignment.commands.cli import main
from alignment.stages.pretrain import run_pretrain
from data.tokenizer.tokenizer import Tokenizer
from models.errors import LanternError
from models.files.atomic import StorageError, write_atomically
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.model import ModelConfig, Transformer
from tests.alignment.test_pretrain_run import RUN_NAME, read_metrics, tiny_config
from tests.helpers import subprocess_env
from trainer.checkpoints import latest_checkpoint
from trainer.storage import RunFolderInUse, claim_run_directory

ROOT = Path(__file__).resolve().parents[2]
QUICK = ("trainer.max_steps=4", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=2")


@pytest.fixture
def native(tmp_path) -> Path:
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=64)
    )
    return save_checkpoint(model, tmp_path / "models" / "native", tokenizer_path=Tokenizer.load("default").path)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("lantern ")]
    assert len(lines) == 1, err
    return lines[0]


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("a user's file")
    return path


# --------------------------------------------------------------------------------------------------
# destinations


@pytest.mark.parametrize("to", ["hf", "native"])
def test_convert_refuses_a_non_empty_destination(native, tmp_path, capsys, to):
    destination = user_folder(tmp_path / "out")
    assert main(["convert", str(native), "--to", to, str(destination)]) == 2
    line = one_error_line(capsys)
    assert "not empty" in line and "--overwrite" in line and "notes.txt" in line
    assert (destination / "notes.txt").read_text() == "a user's file"
    assert sorted(p.name for p in destination.iterdir()) == ["notes.txt"]


def test_convert_never_deletes_the_folder_holding_its_source_even_with_overwrite(native, capsys):
    parent = native.parent  # `lantern convert models/native --to hf models --overwrite`
    assert main(["convert", str(native), "--to", "hf", str(parent), "--overwrite"]) == 2
    assert "contains the source" in one_error_line(capsys)
    assert load_checkpoint(native) is not None
    assert sorted(p.name for p in parent.iterdir()) == ["native"]  # no temporaries either


def test_convert_overwrite_replaces_a_non_empty_destination(native, tmp_path):
    destination = user_folder(tmp_path / "out")
    assert main(["convert", str(native), "--to", "hf", str(destination), "--overwrite"]) == 0
    assert not (destination / "notes.txt").exists() and (destination / "config.json").is_file()
    assert (destination / ".lantern-export").is_file()  # marks it as Lantern's: ExportFinal-style replacement


def test_convert_disk_full_is_one_line_and_leaves_nothing(native, tmp_path, capsys, monkeypatch):
    import models.formats.checkpoint_io

    def full_disk(state, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(models.formats.checkpoint_io, "save_file", full_disk)
    assert main(["convert", str(native), "--to", "hf", str(tmp_path / "hf")]) == 2
    line = one_error_line(capsys)
    assert "no space left on device" in line and str(tmp_path / "hf") in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no half-written folder, no temporary


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    return run_pretrain(tiny_config(data_dir, tmp_path_factory.mktemp("trained"), *QUICK))


def test_export_refuses_non_empty_and_never_the_checkpoints_folder(trained, tmp_path, capsys):
    checkpoint = trained / "checkpoints" / "step-00000004.ckpt"
    destination = user_folder(tmp_path / "out")
    assert main(["export", str(checkpoint), str(destination)]) == 2
    assert "not empty" in one_error_line(capsys)
    assert main(["export", str(checkpoint), str(trained / "checkpoints"), "--overwrite"]) == 2
    assert "contains the source" in one_error_line(capsys)
    assert checkpoint.is_file() and (destination / "notes.txt").is_file()
    assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
    assert load_checkpoint(tmp_path / "exported").config.dim == 128


def test_final_folder_not_written_by_lantern_stops_the_run_before_any_compute(data_dir, tmp_path):
    claim_run_directory(tmp_path / "runs" / RUN_NAME, "pretrain")  # the run folder is Lantern's, its final/ is not
    final = user_folder(tmp_path / "runs" / RUN_NAME / "final")
    with pytest.raises(LanternError, match=r"refusing to replace .*final.*Lantern did not write it"):
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK))
    assert sorted(p.name for p in final.iterdir()) == ["notes.txt"]
    assert not list((tmp_path / "runs" / RUN_NAME / "checkpoints").glob("step-*"))


# --------------------------------------------------------------------------------------------------
# the run-folder lock

HOLDER = """
import sys, time
from pathlib import Path
from trainer.storage import lock_run_directory
lock_run_directory(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(300)
"""


def test_second_run_on_a_locked_folder_names_the_first_and_a_dead_holder_does_not_block(data_dir, tmp_path):
    run_dir = tmp_path / "runs" / RUN_NAME
    run_dir.mkdir(parents=True)
    env = subprocess_env()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderInUse, match=rf"in use by process {holder.pid} on host {socket.gethostname()}"):
            run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK))
        assert not (run_dir / "checkpoints").exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # the stale lock file stays behind; the kernel released the flock
        holder.wait(timeout=30)
    assert (run_dir / ".lantern.lock").is_file()
    run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK))
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-00000004.ckpt"


# --------------------------------------------------------------------------------------------------
# a full or read-only disk


def failing_checkpoint_writer(monkeypatch, code: int, from_step: int) -> None:
    """Checkpoint writes from ``from_step`` on write half a file, then fail with ``code``."""
    real = TorchCheckpointIO.save_checkpoint

    def save(self, checkpoint, path, storage_options=None):
        if checkpoint["global_step"] < from_step:
            return real(self, checkpoint, path, storage_options)
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", save)


@pytest.mark.parametrize(
    ("code", "reason"),
    [(errno.ENOSPC, "no space left on device"), (errno.EROFS, "read-only file system")],
    ids=["disk-full", "read-only"],
)
def test_checkpoint_write_failure_keeps_the_previous_checkpoint_and_the_metrics(
    data_dir, tmp_path, monkeypatch, code, reason
):
    failing_checkpoint_writer(monkeypatch, code, from_step=4)
    with pytest.raises(LanternError) as raised:
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK))
    message = str(raised.value)
    assert "\n" not in message and reason in message and "step-00000004.ckpt" in message
    assert "step-00000002.ckpt is intact" in message and "temporary was removed" in message
    checkpoints = tmp_path / "runs" / RUN_NAME / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest",
        "step-00000002.ckpt",
        "step-00000002.ckpt.sha256",
    ]
    assert latest_checkpoint(checkpoints).name == "step-00000002.ckpt"  # and it verifies
    assert [s for s, _ in read_metrics(tmp_path / "runs" / RUN_NAME)["train/loss"]] == [1, 2, 3, 4]
    assert not (tmp_path / "runs" / RUN_NAME / "final").exists()


class HalfWrite:
    """A file whose writes stop half-way through with ENOSPC."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def write(self, data):
        self.handle.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


def full_disk_open(monkeypatch) -> None:
    real_open = open

    def fake_open(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return HalfWrite(handle) if "w" in mode or "a" in mode else handle

    monkeypatch.setattr(models.files.atomic, "open", fake_open, raising=False)


def test_atomic_write_on_a_full_disk_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "metrics.csv"
    target.write_text("metric,step,value\ntrain/loss,1,5.0\n")
    full_disk_open(monkeypatch)
    with pytest.raises(
        StorageError,
        match=r"cannot write metrics file .*metrics\.csv: no space left on device; the previous version is unchanged",
    ):
        write_atomically(target, "metric,step,value\n" + "train/loss,2,4.0\n" * 1000, what="metrics file")
    assert target.read_text() == "metric,step,value\ntrain/loss,1,5.0\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


def test_metrics_write_failing_at_the_end_never_truncates_nor_loses_the_run(data_dir, tmp_path, monkeypatch):
    import lightning as L

    class DiskFillsUp(L.Callback):  # after the last step's rows and checkpoint were written, before the end's rewrite
        def on_train_epoch_end(self, trainer, *args):
            if trainer.global_step == 4:
                full_disk_open(monkeypatch)

    with pytest.warns(UserWarning, match=r"cannot write .*metrics\.csv .*no space left on device"):
        run_dir = run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK), extra_callbacks=[DiskFillsUp()])
    monkeypatch.undo()
    assert [s for s, _ in read_metrics(run_dir)["train/loss"]] == [1, 2, 3, 4]
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert not list(run_dir.glob(".tmp-*"))


def test_read_only_run_folder_is_one_line_before_any_compute(data_dir, tmp_path, monkeypatch):
    def read_only(path, mode="r", *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(models.files.atomic, "open", read_only, raising=False)
    with pytest.raises(
        LanternError, match=r"^cannot write (run config|folder marker) .*: read-only file system"
    ) as raised:
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", *QUICK))
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "runs" / RUN_NAME / "checkpoints").exists()


def test_a_saved_model_follows_the_umask_as_every_other_file_does(tmp_path):
    """Before: model.safetensors was written 0600 (safetensors' own mode) while every other file was 0644: another
    user could not load a model from a shared root."""
    import os
    import stat

    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.checkpoint import save_checkpoint
    from models.model import ModelConfig, Transformer

    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=4096, max_seq_len=32))
    folder = save_checkpoint(model, tmp_path / "model", tokenizer_path=Tokenizer.load().path)
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o666 & ~umask == modes["lantern.json"], modes


def test_a_model_file_that_cannot_be_opened_is_named_with_the_real_cause(tmp_path, monkeypatch, capsys):
    """Before: safetensors reported any failure to open model.safetensors (an unreadable mode) as "No such file or
    directory". Root reads any mode, so the test makes opening it fail as another user's unreadable file does."""
    import builtins

    from alignment.commands.cli import main
    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.checkpoint import save_checkpoint
    from models.model import ModelConfig, Transformer

    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=4096, max_seq_len=32))
    folder = save_checkpoint(model, tmp_path / "model", tokenizer_path=Tokenizer.load().path)
    weights, real_open = folder / "model.safetensors", builtins.open

    def unreadable(file, *args, **kwargs):
        if str(file) == str(weights):
            raise PermissionError(13, "Permission denied", str(weights))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", unreadable)
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lantern generate: error: ") and "\n" not in err, err
    assert "Permission denied" in err and str(weights) in err and "No such file" not in err, err


def test_of_two_writers_racing_to_one_new_destination_the_second_is_refused(tmp_path):
    """Before: two `lantern convert ... --to native SAME` at once both succeeded and the second replaced the first
    without --overwrite (the emptiness check came long before the rename). Both writers here pass the check, then
    the first installs its folder: the second's install is refused as the check refuses, the first's folder kept."""
    from models.files.atomic import atomic_directory

    target = tmp_path / "model"
    first, second = atomic_directory(target, if_exists="refuse"), atomic_directory(target, if_exists="refuse")
    (first.__enter__() / "weights").write_text("first")
    (second.__enter__() / "weights").write_text("second")
    first.__exit__(None, None, None)
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        second.__exit__(None, None, None)
    assert (target / "weights").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the second's build folder removed
