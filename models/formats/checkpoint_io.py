"""File access and state checks every checkpoint format shares: reading torch files (``weights_only=True`` only, so a
checkpoint never runs code), safetensors and JSON, writing safetensors (a failing disk raised as an ``OSError``), and
checking a native state dict against a ``ModelConfig``. A read failure is one ``CheckpointError`` naming the file; a
state that does not fit its config is reported whole (every missing, unexpected and mis-shaped tensor) in one line.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from pickle import UnpicklingError  # only the exception: nothing here unpickles
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from models.errors import CheckpointError
from models.formats.tokenizer_files import read_json  # torch-free, for the tokenizer loaders
from models.model import ModelConfig, Transformer

__all__ = [
    "WEIGHTS",
    "architecture_differences",
    "check_state",
    "read_json",
    "read_safetensors",
    "read_torch_file",
    "read_torch_weights",
    "save_safetensors",
]

WEIGHTS = "model.safetensors"  # the weights file of a native folder and of an unsharded Hugging Face one


# ---------------------------------------------------------------------------------------------------------
# reading and writing files


def read_torch_file(path: Path, *, mmap: bool = False) -> Any:
    """The only torch.load of the checkpoint code: weights_only=True, so a checkpoint can never run code. Failures
    are one line naming the file; torch's own message (which advises ``weights_only=False``, i.e. running the
    file's code) is never passed on."""
    try:
        # mmap (tensors read on demand) needs torch's zip format; an older file is read whole rather than refused
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except UnpicklingError as error:
        text = str(error)
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if found:  # a well-formed pickle that names Python objects to build: refused, never run
            raise CheckpointError(
                f"{path}: refused: the file is a pickle of Python objects, not only tensors (it references "
                f"{found.group(1)}); loading it could run arbitrary code"
            ) from None
        # anything else the weights-only unpickler stops at (an unknown opcode, random bytes) is damage
        reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        detail = reason.group(1) if reason else text.splitlines()[0]
        raise CheckpointError(f"{path}: not a torch checkpoint (truncated or corrupt: {detail})") from None
    except (RuntimeError, EOFError, ValueError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint ({first})") from None


def read_torch_weights(path: Path, *, mmap: bool = False) -> dict[str, Tensor]:
    """A torch file that must hold a dict of tensors (pytorch_model.bin, Meta's consolidated.NN.pth)."""
    state = read_torch_file(path, mmap=mmap)
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    return dict(state)


def read_safetensors(path: Path) -> dict[str, Tensor]:
    # safetensors reports any failure to open a file as "No such file or directory": opened here first, a file
    # another user's mode keeps unreadable says "Permission denied", with its path
    with open(path, "rb"):
        pass
    try:
        return load_file(path)
    except SafetensorError as error:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({error})") from None


def save_safetensors(state: dict[str, Tensor], path: Path) -> None:
    """The one safetensors write of Lantern. A failed write to disk (full, read-only, no permission) is raised as
    the OSError it is, with its errno and ``path``, so that the folder writer around it (``atomic_directory``)
    removes what it built and reports it in one line like any other write (``storage_error``)."""
    try:
        # "format": "pt" is the metadata transformers checks for before it trusts a safetensors file.
        save_file(state, str(path), metadata={"format": "pt"})
        # safetensors creates its file 0600; every other file Lantern writes follows the umask (0644 for most): a
        # model another user (a shared model root) cannot read would be the odd one out
        os.chmod(path, _FILE_MODE)
    except SafetensorError as error:
        # safetensors' Rust writer wraps the OS error in a SafetensorError (not an OSError), its errno in the text
        found = _OS_ERRNO.search(str(error))
        if found is None:
            raise
        code = int(found.group(1) or found.group(2))
        raise OSError(code, os.strerror(code), str(path)) from error


def _umask() -> int:
    mask = os.umask(0o022)  # read by setting it: there is no other portable way; put back at once
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() gives a new file under this process's umask


# "I/O error: No space left on device (os error 28)" (safetensors >= 0.5) or "IoError(Os { code: 28, ...})" (0.4)
_OS_ERRNO = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")


# ---------------------------------------------------------------------------------------------------------
# checking a state against its config


def check_state(state: Mapping[str, Tensor], config: ModelConfig, source: str) -> None:
    """Raise one ValueError listing every missing, unexpected and mis-shaped tensor."""
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [
        f"{name}: checkpoint {tuple(state[name].shape)} vs model {tuple(shape)}"
        for name, shape in expected.items()
        if name in state and state[name].shape != shape
    ]
    problems = []
    if mismatched:  # first: a shape names the key, the found and the expected shape
        problems.append(f"shape mismatches ({len(mismatched)}): {'; '.join(mismatched[:8])}")
    if missing:
        problems.append(f"missing keys ({len(missing)}): {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_listed(unexpected)}")
    if problems:  # one line: the CLI prints it as is
        raise CheckpointError(f"{source} does not match its config: " + " | ".join(problems))


# what decides a model's tensors and their shapes, and what its block computes with them (Gemma's options: the same
# tensors, another model); the rest (max_seq_len, RoPE, attention backend) may change
ARCHITECTURE = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "vocab_size",
    "hidden_dim",
    "tie_embeddings",
    "qk_norm",
    "qkv_bias",
    "sandwich_norms",
    "embedding_scale",
    "norm_weight_offset",
    "activation",
    "attention_scale_dim",
    "sliding_window",
    "sliding_window_pattern",
)


def architecture_differences(old: ModelConfig, new: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(field, old value, new value) for every field of ARCHITECTURE in which the two models differ."""
    return [
        (key, getattr(old, key), getattr(new, key)) for key in ARCHITECTURE if getattr(old, key) != getattr(new, key)
    ]


def _expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = Transformer(config)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    if config.tie_embeddings:
        del shapes["output.weight"]
    return shapes


def _listed(names: list[str], limit: int = 8) -> str:
    """A key list short enough for one line (a wrong-model checkpoint can miss hundreds)."""
    shown = repr(names[:limit])
    return shown if len(names) <= limit else f"{shown[:-1]}, ... {len(names) - limit} more]"
