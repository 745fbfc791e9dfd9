"""Consolidate a training checkpoint (a single .ckpt file, or the folder of per-rank shards that FSDP2 writes)
into one native model folder that ``load_checkpoint`` and ``lantern convert`` read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint
from torch.distributed.checkpoint.api import CheckpointException

from data.tokenizer.tokenizer import Tokenizer
from models.atomic import IfExists, check_destination
from models.checkpoint import save_checkpoint
from models.checkpoint_io import read_torch_file
from models.errors import CheckpointError
from models.model import ModelConfig, Transformer
from trainer.parallel import plain_name


def read_training_checkpoint(path: str | Path) -> dict[str, Any]:
    """The whole training checkpoint as one dict on CPU, without a process group (weights_only loading)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"training checkpoint {path} does not exist")
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise ValueError(f"{path} is a folder but not a sharded (torch.distributed.checkpoint) checkpoint")
        try:
            checkpoint = _load_distributed_checkpoint(path)
        # torch.distributed.checkpoint's errors are multi-line tracebacks of ranks (CheckpointException is
        # a BaseException); the first line says what failed
        except (CheckpointException, RuntimeError, ValueError, OSError, KeyError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"{path}: unreadable sharded checkpoint ({first})") from None
        checkpoint.update(read_torch_file(path / _METADATA_FILENAME))
        return checkpoint
    checkpoint = read_torch_file(path)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path}: not a training checkpoint (holds a {type(checkpoint).__name__}, not a dict)")
    return checkpoint


def export_training_checkpoint(
    path: str | Path, out: str | Path, *, prefix: str = "model.", overwrite: bool = False
) -> Path:
    """Write the ``prefix``-ed submodule of a training checkpoint (the LM by default) as a native folder.
    A non-empty ``out`` is refused unless ``overwrite``; one that is or contains ``path``, always (both
    checked before anything is read)."""
    if_exists: IfExists = "replace" if overwrite else "refuse"
    check_destination(out, if_exists=if_exists, sources=(path,))
    checkpoint = read_training_checkpoint(path)
    try:
        config = checkpoint["hyper_parameters"]["config"]
    except KeyError as error:
        raise ValueError(
            f"{path} holds no Lantern config (hyper_parameters.config): not a Lantern checkpoint"
        ) from error
    model_config = ModelConfig.from_dict(config["model"])
    state = {
        plain_name(name[len(prefix) :]): tensor
        for name, tensor in checkpoint["state_dict"].items()
        if name.startswith(prefix)
    }
    with torch.device("meta"):
        model = Transformer(model_config)
    missing, unexpected = model.load_state_dict(state, assign=True, strict=False)
    missing = [name for name in missing if not (name == "output.weight" and model_config.tie_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config: missing {missing}, unexpected {unexpected}")
    if model_config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    tokenizer = (config.get("data") or {}).get("tokenizer") or config.get("tokenizer")
    tokenizer_path = tokenizer if tokenizer and Path(str(tokenizer)).is_file() else None
    if tokenizer_path is None and tokenizer:
        resolved = Tokenizer.load(tokenizer).path
        tokenizer_path = resolved if Path(str(resolved)).is_file() else None
    metadata = {"step": checkpoint.get("global_step"), "exported_from": str(path)}
    return save_checkpoint(
        model, out, tokenizer_path=tokenizer_path, metadata=metadata, if_exists=if_exists, sources=(path,)
    )
