"""Training checkpoints on disk: their names, the SHA-256 manifest beside each, whether one loads, and the newest.
Light at import (no torch, no Lightning): the interrupt message finds the last checkpoint with it."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

from models.errors import CheckpointError
from models.files.atomic import remove_path, write_atomically
from models.files.checksums import manifest_mismatch, sha256_manifest

MANIFEST_SUFFIX = ".sha256"
CHECKPOINT_PATTERN = re.compile(r"step-(\d+)\.ckpt")
LATEST = "latest"  # a file naming the newest complete checkpoint, for people: resume scans and verifies instead


def checkpoint_step(path: Path) -> int | None:
    match = CHECKPOINT_PATTERN.fullmatch(path.name)
    return int(match.group(1)) if match else None


def has_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` holds any training checkpoint (verified or not): what resume=auto would look at."""
    return directory.is_dir() and any(checkpoint_step(p) is not None for p in directory.iterdir())


def manifest_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + MANIFEST_SUFFIX)


def write_manifest(written: Path, checkpoint: Path, step: int) -> Path:
    """Hash ``written`` (the temporary a checkpoint was saved to, a file or a shard folder) and write the manifest of
    ``checkpoint`` (its final name) atomically, before the rename: a checkpoint under its final name has one."""
    manifest = {"format": "lantern-checksums", "version": 1, "step": step, "sha256": sha256_manifest(written)}
    return write_atomically(
        manifest_path(checkpoint), json.dumps(manifest, indent=1) + "\n", what="checkpoint manifest"
    )


def remove_checkpoint(checkpoint: Path) -> None:
    """A checkpoint and its manifest (the checkpoint first: a manifest alone is never mistaken for one)."""
    remove_path(checkpoint)
    manifest_path(checkpoint).unlink(missing_ok=True)


def read_checkpoint_header(path: Path) -> dict[str, Any]:
    """What a training checkpoint says of itself without reading its tensors: the dict Lightning saved, with
    ``hyper_parameters``. A CheckpointError names the file and why it is not one (a pickle of Python objects is
    refused, never loaded; a model's weights are not a training checkpoint)."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    from models.formats.checkpoint_io import read_torch_file

    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"{path} is a folder but not a sharded training checkpoint (no .metadata)")
        header = read_torch_file(path / _METADATA_FILENAME, mmap=True)
    else:
        header = read_torch_file(path, mmap=True)
        if isinstance(header, dict) and "state_dict" not in header:
            raise CheckpointError(
                f"{path} holds {'model weights' if header else 'an empty dict'}, not a training checkpoint (no "
                "state_dict, optimizer or loop state): start from a model with init.checkpoint instead"
            )
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a training checkpoint (it holds a {type(header).__name__})")
    return header


def training_checkpoint_problem(path: Path) -> str | None:
    """None when ``path`` reads as a training checkpoint; else why not."""
    try:
        read_checkpoint_header(path)
    except CheckpointError as error:
        return str(error)
    return None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """None when ``checkpoint`` matches its manifest and reads as a training checkpoint; else why not. One from
    before manifests existed (none beside it) is accepted unverified, with a warning."""
    path = manifest_path(checkpoint)
    if not path.is_file():
        if checkpoint.exists():
            warnings.warn(f"checkpoint {checkpoint} has no checksum manifest ({path.name}): using it unverified")
            return training_checkpoint_problem(checkpoint)
        return "missing"
    try:
        expected = json.loads(path.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest {path.name} ({error})"
    return manifest_mismatch(checkpoint, expected) or training_checkpoint_problem(checkpoint)


def latest_checkpoint(directory: str | Path, *, verified: bool = True) -> Path | None:
    """The ``step-*.ckpt`` of ``directory`` with the highest step, or None. ``verified``: the newest that matches its
    manifest and loads, newer ones being skipped with a warning naming them; without it nothing is read (for the
    moment of a Ctrl-C: resume verifies anyway). Never the ``latest`` pointer, which a kill can leave stale."""
    directory = Path(directory)
    try:
        candidates = sorted(
            (p for p in directory.iterdir() if checkpoint_step(p) is not None), key=checkpoint_step, reverse=True
        )
    except OSError:  # no checkpoint folder yet
        return None
    if not verified:
        return candidates[0] if candidates else None
    for candidate in candidates:
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate
        warnings.warn(f"skipping checkpoint {candidate}: {problem}; trying an older one")
    return None
