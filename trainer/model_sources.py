"""The model a run starts from, in every form Lantern reads: a model folder (native, Hugging Face, Meta), a GGUF file,
or a training checkpoint (a ``.ckpt`` file or FSDP2's sharded folder): its config without its weights, its weights,
and the tokenizer it was trained with."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from data.tokenizer.files import find_tokenizer
from models.errors import ConfigError
from models.files.atomic import atomic_directory
from models.files.digests import folder_fingerprint
from models.formats.checkpoint import load_checkpoint, load_model_config
from models.formats.checkpoint_io import read_torch_file
from models.model import ModelConfig, Transformer

SourceKind = Literal["folder", "gguf", "training"]
SOURCES = (
    "a model folder (native, Hugging Face, Meta), a .gguf file, or a training checkpoint (.ckpt or sharded folder)"
)


def source_kind(path: str | Path) -> SourceKind:
    """Which form ``path`` is: a ``.gguf`` file, a training checkpoint, else a model folder."""
    path = Path(path).expanduser()
    if path.suffix == ".gguf":
        return "gguf"
    if path.suffix == ".ckpt" or (path / ".metadata").is_file():
        return "training"
    return "folder"


def source_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a model to start from, by its form alone, or None (a missing path is not judged here:
    a config may name a folder an earlier stage or command writes; ``require_source`` refuses it before use)."""
    path = Path(path).expanduser()
    if path.is_file() and source_kind(path) == "folder":
        return f"{path} is a file but neither a .gguf file nor a .ckpt training checkpoint: give {SOURCES}"
    return None


def require_source(path: str | Path, key: str) -> None:
    """Refuse, in one line naming ``key``, a model source that is not there (before anything reads it)."""
    if not Path(path).expanduser().exists():
        raise ConfigError(f"{key}: {path} does not exist: give {SOURCES}")


def _training_config(path: Path) -> dict:
    """The Lantern config a training checkpoint was written with (its hyper_parameters), read without its tensors."""
    from trainer.export import lantern_config

    if path.is_dir():  # the sharded folder keeps its non-tensor state in Lightning's metadata file
        from lightning.fabric.utilities.load import _METADATA_FILENAME

        return lantern_config(read_torch_file(path / _METADATA_FILENAME), path)
    return lantern_config(read_torch_file(path, mmap=True), path)


def source_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of any model source, without reading (or dequantizing) its weights."""
    path = Path(path).expanduser()
    kind = source_kind(path)
    if kind == "gguf":
        from models.formats.gguf_format import read_gguf_config

        return read_gguf_config(path)
    if kind == "training":
        return ModelConfig.from_dict(_training_config(path)["model"])
    return load_model_config(path)


def load_source_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """The model of any source on CPU in ``dtype`` (a GGUF dequantized; a LoRA training checkpoint merged)."""
    path = Path(path).expanduser()
    kind = source_kind(path)
    if kind == "gguf":
        from models.formats.gguf_format import load_gguf

        return load_gguf(path, dtype)[0]
    if kind == "training":
        from trainer.export import training_checkpoint_model

        return training_checkpoint_model(path)[0].to(dtype)
    return load_checkpoint(path, dtype=dtype)


def source_tokenizer(path: str | Path, cache: str | Path) -> str | None:
    """The tokenizer a model source carries, as a spec ``load_tokenizer`` reads, or None when it names none. A GGUF
    file's is written once, as Hugging Face files, to ``cache``/NAME-FINGERPRINT (the same bytes for every command
    that reads it, so data prepared with it matches its fingerprint later)."""
    path = Path(path).expanduser()
    kind = source_kind(path)
    if kind == "training":
        from trainer.export import recorded_tokenizer

        return recorded_tokenizer(_training_config(path))
    if kind == "folder":
        found = find_tokenizer(path) if path.is_dir() else None
        return str(found.absolute()) if found is not None else None
    from models.formats.gguf_format import check_gguf_file

    check_gguf_file(path)  # before transformers parses it
    folder = Path(cache).expanduser().absolute() / f"{path.stem}-{folder_fingerprint(path)}"
    if not (folder / "tokenizer.json").is_file():
        from models.formats.gguf_tokenizer import write_gguf_tokenizer_files

        with atomic_directory(folder, what="GGUF tokenizer files", sources=(path,)) as scratch:
            write_gguf_tokenizer_files(path, scratch)
    return str(folder / "tokenizer.json")
