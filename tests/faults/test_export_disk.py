"""A full or read-only disk under every writer of model files (`lantern export` native / Hugging Face / GGUF / peft
adapter, `lantern convert`, a reward model's folder): one line naming the destination, and nothing half-written
left, neither the folder nor a temporary. The disk fails inside safetensors' writer, as it does for real: a
``SafetensorError`` wrapping the OS error (not an ``OSError``), after part of the file was written.
"""

from __future__ import annotations

import errno
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from alignment.commands.cli import main
from models.adapters import add_adapters, base_fingerprint, trained_names
from models.files.atomic import StorageError
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.heads import HEAD_WEIGHTS, ScalarModel, save_scalar_model
from models.model import ModelConfig, Transformer
from models.model_config import PeftConfig

CONFIG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, max_seq_len=64)
PEFT = PeftConfig(kind="lora", rank=4, alpha=8.0)
# errno, safetensors' own words (0.5 and later), what Lantern's line says
DISKS = {
    "disk-full": (errno.ENOSPC, "No space left on device", "no space left on device"),
    "read-only": (errno.EROFS, "Read-only file system", "read-only file system"),
}


def failing_disk(monkeypatch, disk: str, only: str = "") -> None:
    """Every safetensors write (of a file whose name contains ``only``) writes half a file, then fails as
    safetensors reports a full or read-only disk."""
    code, words, _ = DISKS[disk]
    real = safetensors.torch.serialize_file

    def serialize_file(tensors, filename, metadata=None):
        if only not in os.path.basename(filename):
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"half a file")
        raise SafetensorError(f"Error while serializing: I/O error: {words} (os error {code})")

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)


def training_checkpoint(path: Path, model: torch.nn.Module, adapters: dict | None = None) -> Path:
    """What `lantern export` reads: the config, the trained tensors, and with adapters the base's record."""
    names = trained_names(model) if adapters else set(model.state_dict())
    checkpoint = {
        "hyper_parameters": {"config": {"model": CONFIG.to_dict(), "data": {"tokenizer": "default"}}},
        "state_dict": {f"model.{name}": t for name, t in model.state_dict().items() if name in names},
        "global_step": 3,
    }
    if adapters:
        checkpoint["adapters"] = {"model": adapters}
    torch.save(checkpoint, path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """plain.ckpt (every weight), base/ (a native folder) and lora.ckpt (LoRA adapters trained on base/)."""
    folder = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    training_checkpoint(folder / "plain.ckpt", Transformer(CONFIG))
    save_checkpoint(Transformer(CONFIG), folder / "base")
    base = load_checkpoint(folder / "base", dtype=torch.float32)
    record = {
        "checkpoint": str((folder / "base").resolve()),
        "seed": None,
        "model": base.config.to_dict(),
        "fingerprint": base_fingerprint(base),
        "peft": asdict(PEFT),
    }
    add_adapters(base, PEFT)
    training_checkpoint(folder / "lora.ckpt", base, record)
    return folder


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "SafetensorError" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("INFO")]
    assert len(lines) == 1 and lines[0].startswith(f"lantern {command}: error: "), err
    return lines[0]


EXPORTS = {
    "native": ("plain.ckpt", []),
    "hf": ("plain.ckpt", ["--format", "hf"]),
    "merged-hf": ("lora.ckpt", ["--format", "hf"]),
    "adapter": ("lora.ckpt", ["--adapter"]),
}


@pytest.mark.parametrize("disk", DISKS)
@pytest.mark.parametrize("kind", EXPORTS)
def test_export_on_a_failing_disk_is_one_line_naming_the_destination_and_leaves_nothing(
    inputs, tmp_path, capsys, monkeypatch, kind, disk
):
    """Before: a SafetensorError traceback (and for --adapter the line would have named the hidden temporary)."""
    checkpoint, options = EXPORTS[kind]
    out = tmp_path / "out"
    failing_disk(monkeypatch, disk)
    assert main(["export", str(inputs / checkpoint), str(out), *options]) == 2
    line = one_error_line(capsys, "export")
    assert line.startswith("lantern export: error: cannot write ") and line.endswith(
        f" {out}: {DISKS[disk][2]}; nothing was left behind"
    ), line
    assert list(tmp_path.iterdir()) == []  # no half-written folder, no temporary


def test_export_overwrite_on_a_full_disk_keeps_the_previous_export_intact(inputs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(["export", str(inputs / "plain.ckpt"), str(out), "--format", "hf"]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    failing_disk(monkeypatch, "disk-full")
    assert main(["export", str(inputs / "plain.ckpt"), str(out), "--format", "hf", "--overwrite"]) == 2
    line = one_error_line(capsys, "export")
    assert f"{out}: no space left on device; the previous folder is intact" in line, line
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("disk", DISKS)
def test_export_gguf_on_a_failing_disk_is_one_line_and_leaves_nothing(inputs, tmp_path, capsys, monkeypatch, disk):
    import gguf

    code, words, said = DISKS[disk]

    def write_tensors_to_file(self, *args, **kwargs):
        raise OSError(code, words)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", write_tensors_to_file)
    out = tmp_path / "model.gguf"
    assert main(["export", str(inputs / "plain.ckpt"), str(out), "--format", "gguf"]) == 2
    assert f"cannot write GGUF file {out}: {said}; nothing was written" in one_error_line(capsys, "export")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("to", ["native", "hf"])
def test_convert_when_safetensors_reports_a_full_disk_is_one_line_and_leaves_nothing(
    inputs, tmp_path, capsys, monkeypatch, to
):
    """Before: the convert test raised an OSError in place of safetensors' own SafetensorError, and passed; the real
    error was a traceback."""
    failing_disk(monkeypatch, "disk-full")
    assert main(["convert", str(inputs / "base"), "--to", to, str(tmp_path / "out")]) == 2
    line = one_error_line(capsys, "convert")
    assert f"{tmp_path / 'out'}: no space left on device; nothing was left behind" in line, line
    assert list(tmp_path.iterdir()) == []


def test_save_checkpoint_on_a_read_only_disk_is_a_storage_error_naming_the_folder(tmp_path, monkeypatch):
    failing_disk(monkeypatch, "read-only")
    with pytest.raises(StorageError, match=r"read-only file system; nothing was left behind$") as caught:
        save_checkpoint(Transformer(CONFIG), tmp_path / "model")
    assert caught.value.errno == errno.EROFS and caught.value.filename == str(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_a_reward_model_whose_head_cannot_be_written_leaves_no_folder_without_its_head(tmp_path, monkeypatch):
    """Before: the backbone's folder was already in place when the head's write failed, so a folder that is no
    reward model (no scalar_head.safetensors) was left behind, with a SafetensorError."""
    failing_disk(monkeypatch, "disk-full", only=HEAD_WEIGHTS)
    with pytest.raises(StorageError, match=r"no space left on device; nothing was left behind$"):
        save_scalar_model(ScalarModel.from_backbone(Transformer(CONFIG)), tmp_path / "rm")
    assert list(tmp_path.iterdir()) == []


def test_export_gguf_when_numpy_reports_a_short_write_says_the_disk_is_full(inputs, tmp_path, capsys, monkeypatch):
    """Before: a full disk under the GGUF writer (numpy's tofile) read "1048576 requested and 0 written", with no
    word of the disk: numpy reports a short write without an errno."""
    import gguf

    def write_tensors_to_file(self, *args, **kwargs):
        raise OSError("1048576 requested and 0 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", write_tensors_to_file)
    out = tmp_path / "model.gguf"
    assert main(["export", str(inputs / "plain.ckpt"), str(out), "--format", "gguf"]) == 2
    assert f"cannot write GGUF file {out}: no space left on device; nothing was written" in one_error_line(
        capsys, "export"
    )
    assert list(tmp_path.iterdir()) == []
