"""Checkpoint interop, the one public entry (``load_checkpoint``, ``save_checkpoint``, ``load_model_config``,
``detect_format``, ``convert``, ``export_hf``, ``write_hf_folder``): Lantern's native folder, Hugging Face
Llama-family folders and Meta's consolidated shards, all loaded into one ``Transformer``.

The native folder (``models.formats.native_folder``, which writes it) is a Hugging Face folder transformers loads as it
is, plus ``lantern.json`` (format, version, ``ModelConfig.to_dict()``, metadata, the tokenizer's sha256); Lantern
reads its config from lantern.json. Version 1 folders (native parameter names, no config.json) are still read.
Folders are written atomically, so a crash mid-save never leaves a half-written checkpoint where a good one was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import CheckpointError
from models.files.atomic import IfExists, atomic_directory, check_destination
from models.formats.checkpoint_io import WEIGHTS, check_state, read_json, read_safetensors
from models.formats.hf_format import config_to_hf, hf_special_ids, load_hf, load_hf_config, read_hf_weights_as_native
from models.formats.meta_format import load_meta, load_meta_config
from models.formats.native_folder import (
    NATIVE_CONFIG,
    NATIVE_FORMAT_VERSION,
    READABLE_VERSIONS,
    TOKENIZER_RECORD,
    native_state,
    save_checkpoint,
    unwrap,
    write_hf_folder,
)
from models.formats.tokenizer_files import TokenizerFiles, tokenizer_files_in
from models.model import ModelConfig, Transformer

__all__ = [
    "FORMATS",
    "NATIVE_FORMAT_VERSION",
    "TOKENIZER_RECORD",
    "convert",
    "detect_format",
    "export_hf",
    "load_checkpoint",
    "load_model_config",
    "native_state",
    "save_checkpoint",
    "unwrap",
    "write_hf_folder",
]

FORMATS = ("native", "hf", "meta")

PathLike = str | os.PathLike


# ---------------------------------------------------------------------------------------------------------
# format detection and configs


def detect_format(path: PathLike) -> str:
    """ "native" (lantern.json), "hf" (config.json) or "meta" (params.json, also under original/)."""
    directory = _checkpoint_dir(path)
    if (directory / NATIVE_CONFIG).is_file():
        return "native"
    if (directory / "config.json").is_file():
        return "hf"
    if (directory / "params.json").is_file() or (directory / "original" / "params.json").is_file():
        return "meta"
    present = sorted(p.name for p in directory.iterdir())[:20]
    raise FileNotFoundError(
        f"{directory} is not a recognised checkpoint folder. Expected one of: "
        f"{NATIVE_CONFIG} + {WEIGHTS} (Lantern); config.json + model.safetensors, "
        "model.safetensors.index.json or pytorch_model.bin (Hugging Face Llama, Mistral or Qwen2); "
        f"params.json + consolidated.00.pth (Meta). Found: {present}"
    )


def _checkpoint_dir(path: PathLike) -> Path:
    path = Path(path)
    if path.is_file() and path.name in (NATIVE_CONFIG, "config.json", "params.json"):
        return path.parent
    if not path.exists():
        hint = ""
        if path.parent.is_dir():
            aside = sorted(path.parent.glob(f".{path.name}.old-*"))
            if aside:  # a save crashed between its two renames; the previous checkpoint sits here intact
                hint = f" (a previous version was set aside at {aside[-1]}; rename it back to recover)"
        raise FileNotFoundError(f"checkpoint not found: {path}{hint}")
    if not path.is_dir():
        raise ValueError(f"{path} is a file; pass the checkpoint folder")
    return path


def _resolve_format(path: PathLike, fmt: str) -> str:
    if fmt == "auto":
        return detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; expected one of {('auto',) + FORMATS}")
    directory = Path(path)
    markers = {"native": [NATIVE_CONFIG], "hf": ["config.json"], "meta": ["params.json", "original/params.json"]}
    if directory.is_dir() and not any((directory / name).is_file() for name in markers[fmt]):
        with contextlib.suppress(FileNotFoundError):  # nothing recognisable: the loader says what is missing
            found = detect_format(directory)
            raise ValueError(
                f"{directory} is a {_FORMAT_NAMES[found]} checkpoint folder, not a {_FORMAT_NAMES[fmt]} one: "
                f"read it as {found} (lantern convert --from {found}, or --from auto)"
            )
    return fmt


_FORMAT_NAMES = {"native": "native (Lantern)", "hf": "Hugging Face", "meta": "Meta"}


def load_model_config(path: PathLike, *, format: str = "auto") -> ModelConfig:
    """The ModelConfig of a native, Hugging Face or Meta checkpoint, without loading its weights."""
    directory = _checkpoint_dir(path)
    fmt = _resolve_format(directory, format)
    if fmt == "native":
        return _native_config(directory)
    if fmt == "hf":
        return load_hf_config(directory)
    return load_meta_config(directory)


def _native_config(directory: Path) -> ModelConfig:
    info = read_json(directory / NATIVE_CONFIG)
    if info.get("format") != "lantern":
        raise CheckpointError(f"{directory / NATIVE_CONFIG}: format is {info.get('format')!r}, expected 'lantern'")
    if info.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{directory / NATIVE_CONFIG}: version {info.get('version')!r} is not supported "
            f"(this code reads versions {', '.join(map(str, READABLE_VERSIONS))}: a newer Lantern wrote it)"
        )
    if not isinstance(info.get("model"), dict):
        raise CheckpointError(f"{directory / NATIVE_CONFIG}: no 'model' section: not a Lantern checkpoint")
    try:
        return ModelConfig.from_dict(info["model"])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{directory / NATIVE_CONFIG}: invalid model config: {error}") from None


# ---------------------------------------------------------------------------------------------------------
# loading


def _load_native(directory: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    config = _native_config(directory)
    if (
        read_json(directory / NATIVE_CONFIG)["version"] >= 2
    ):  # Hugging Face's names and layout, config from lantern.json
        return config, read_hf_weights_as_native(directory, config, f"native checkpoint {directory}")
    if not (directory / WEIGHTS).is_file():
        raise FileNotFoundError(f"{directory}: {NATIVE_CONFIG} found but no {WEIGHTS}")
    return config, read_safetensors(directory / WEIGHTS)


_LOADERS = {"native": _load_native, "hf": load_hf, "meta": load_meta}


def load_checkpoint(
    path: PathLike,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    format: str = "auto",
) -> Transformer:
    """Load a native, Hugging Face (Llama) or Meta checkpoint folder into a Transformer.

    ``dtype`` None keeps the checkpoint's dtype; pass torch.float32 for training master weights.
    Raises FileNotFoundError for an unrecognised folder and ValueError listing every missing / unexpected /
    mis-shaped tensor.
    """
    directory = _checkpoint_dir(path)
    fmt = _resolve_format(directory, format)
    config, state = _LOADERS[fmt](directory)
    return _build_model(config, state, f"{fmt} checkpoint {directory}", device, _as_dtype(dtype))


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _build_model(
    config: ModelConfig, state: dict[str, Tensor], source: str, device: torch.device | str, dtype: torch.dtype | None
) -> Transformer:
    """Check ``state`` (native names) against ``config`` and build the model without a random init.

    dtype None keeps the checkpoint's dtype (that of tok_embeddings.weight, like transformers' dtype="auto").
    """
    check_state(state, config, source)
    dtype = dtype or state["tok_embeddings.weight"].dtype
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    if config.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    with torch.device("meta"):  # no memory, no init: every tensor is assigned from the checkpoint below
        model = Transformer(config)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:  # assign=True replaced the shared Parameter; tie again
        model.output.weight = model.tok_embeddings.weight
    return model.to(device)


# ---------------------------------------------------------------------------------------------------------
# writing


def export_hf(
    model_or_checkpoint_path: nn.Module | PathLike,
    out_dir: PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str | None = None,
    tokenizer_path: PathLike | TokenizerFiles | None = None,
    if_exists: IfExists = "replace-lantern",
) -> Path:
    """Write a Hugging Face folder of the model's family (``ModelConfig.hf_architecture``: config.json, safetensors,
    generation_config.json), atomically.
    An existing folder is replaced as ``save_checkpoint`` says (``if_exists``).

    Accepts a Transformer or any checkpoint folder load_checkpoint reads. The tokenizer (``tokenizer_path`` or the
    checkpoint's own files) is copied: tokenizer.json and its companions at the top, a tiktoken rank file to
    original/tokenizer.model, as in Meta's Hugging Face repos. bos/eos ids
    come from the checkpoint metadata (bos_token_id / eos_token_id) or else from that tokenizer file. A full or
    read-only disk is a one-line ``StorageError`` naming ``out_dir``, with nothing half-written left.
    """
    metadata: dict[str, Any] = {}
    sources: tuple[PathLike, ...] = ()
    if isinstance(model_or_checkpoint_path, nn.Module):
        model = unwrap(model_or_checkpoint_path)
    else:
        sources = (model_or_checkpoint_path,)
        source = _checkpoint_dir(model_or_checkpoint_path)
        model = load_checkpoint(source)
        if detect_format(source) == "native":
            metadata = read_json(source / NATIVE_CONFIG).get("metadata", {})
        if tokenizer_path is None:
            tokenizer_path = tokenizer_files_in(source)
    return _export_hf(model, out_dir, _as_dtype(dtype), max_shard_size, tokenizer_path, metadata, if_exists, sources)


def _export_hf(
    model: Transformer,
    out_dir: PathLike,
    dtype: torch.dtype | None,
    max_shard_size: int | str | None,
    tokenizer_path: PathLike | TokenizerFiles | None,
    metadata: Mapping[str, Any],
    if_exists: IfExists = "replace-lantern",
    sources: tuple[PathLike, ...] = (),
) -> Path:
    config_to_hf(model.config, torch.float32, None, None)  # an unsupported config: refused before any disk write
    target = Path(out_dir)
    with atomic_directory(target, if_exists=if_exists, sources=sources, what="Hugging Face export") as tmp:
        write_hf_folder(
            model, tmp, dtype=dtype, max_shard_size=max_shard_size, tokenizer_path=tokenizer_path, metadata=metadata
        )
    return target


def convert(
    src: PathLike,
    src_format: str = "auto",
    dst: PathLike | None = None,
    dst_format: str = "native",
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
    tokenizer_path: PathLike | TokenizerFiles | None = None,
) -> Path:
    """Convert a checkpoint folder (hf / meta / native / auto) to a native or Hugging Face folder.

    The tokenizer files in ``src`` (``models.formats.tokenizer_files``), or ``tokenizer_path``, travel along; Hugging Face bos/eos ids are kept in the
    native metadata (and written back on export). ``dtype`` None keeps the source dtype. A non-empty ``dst``
    is refused unless ``overwrite``, and a ``dst`` that is or contains ``src`` always (checked before reading
    any weights).
    """
    if dst is None:
        raise ValueError("convert needs a destination folder (dst)")
    if dst_format not in ("native", "hf"):
        raise ValueError(f"unknown destination format {dst_format!r}; expected 'native' or 'hf'")
    source = _checkpoint_dir(src)
    if source.resolve() == Path(dst).resolve():
        raise ValueError(f"convert: source and destination are the same folder ({source})")
    if_exists: IfExists = "replace" if overwrite else "refuse"
    check_destination(dst, if_exists=if_exists, sources=(source,))
    fmt = _resolve_format(source, src_format)
    model = load_checkpoint(source, format=fmt, dtype=dtype)
    tokenizer = tokenizer_path if tokenizer_path is not None else tokenizer_files_in(source)
    metadata: dict[str, Any] = {}
    if fmt == "native":
        metadata = read_json(source / NATIVE_CONFIG).get("metadata", {})
    elif fmt == "hf":
        metadata = hf_special_ids(source)
    if dst_format == "hf":
        return _export_hf(model, dst, None, max_shard_size, tokenizer, metadata, if_exists, (source,))
    metadata = {**metadata, "converted_from": {"format": fmt, "path": str(source.absolute())}}
    return save_checkpoint(
        model, dst, tokenizer_path=tokenizer, metadata=metadata, if_exists=if_exists, sources=(source,)
    )
