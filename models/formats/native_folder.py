"""Writing Lantern's model folder: a Hugging Face folder transformers loads as it is (config.json, model.safetensors
under Hugging Face's names, generation_config.json, tokenizer.json) plus ``lantern.json``, Lantern's own record (the
exact ``ModelConfig``, metadata, the tokenizer files' sha256). ``write_hf_folder`` writes the Hugging Face part for
both this folder and ``lantern export --format hf``.

Native format versions: 2 (this layout) is written; 1 (native parameter names, no config.json) is still read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from models.files.atomic import EXPORT_MARKER, IfExists, atomic_directory
from models.files.checksums import sha256_file
from models.formats.checkpoint_io import save_safetensors
from models.formats.hf_format import config_to_hf, native_to_hf_state, write_hf_weights
from models.formats.tokenizer_files import (
    RANK_FILE,
    TokenizerFiles,
    as_tokenizer_files,
    copy_tokenizer_files,
    special_ids,
)
from models.model import Transformer

NATIVE_FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: lantern.json + model.safetensors under Lantern's own parameter names
TOKENIZER_RECORD = "tokenizer_sha256"  # lantern.json: {tokenizer file name: sha256} of the files saved with the weights
NATIVE_CONFIG = "lantern.json"

PathLike = str | os.PathLike

log = logging.getLogger(__name__)


def unwrap(model: nn.Module) -> Transformer:
    """The Transformer inside torch.compile's wrapper or a LightningModule holding it as ``.model``."""
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, Transformer) and isinstance(getattr(model, "model", None), nn.Module):
        model = getattr(model.model, "_orig_mod", model.model)
    if not isinstance(model, Transformer):
        raise TypeError(f"expected a models.model.Transformer, got {type(model).__name__}")
    return model


def native_state(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """CPU state dict ready for safetensors; a tied output.weight is left out (it IS tok_embeddings.weight)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and model.config.tie_embeddings:
            continue
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    return state


def save_checkpoint(
    model: nn.Module,
    directory: PathLike,
    *,
    tokenizer_path: PathLike | TokenizerFiles | None = None,
    metadata: Mapping[str, Any] | None = None,
    if_exists: IfExists = "replace-lantern",
    sources: tuple[PathLike, ...] = (),
    extra_weights: Mapping[str, dict[str, Tensor]] | None = None,
) -> Path:
    """Write ``model`` as Lantern's model folder (a transformers folder + lantern.json), atomically.

    ``metadata`` must be JSON-serialisable (step, tokenizer ids, ...); it is stored in lantern.json.
    ``tokenizer_path`` (a tiktoken rank file, copied in as tokenizer.model, or a tokenizer's ``files``: Hugging
    Face's tokenizer.json and companions, with the rank file a tokenizer.json was converted from) is copied in.
    ``extra_weights`` (file name -> tensors: a reward model's head) are written into the same folder, so that it
    appears whole or not at all. An existing non-empty folder is replaced only when Lantern wrote it (``if_exists``
    "replace-lantern"), when ``if_exists`` is "replace", never with "refuse"; never one that contains ``sources``
    (see ``models.files.atomic.check_destination``). A full or read-only disk is a one-line ``StorageError`` naming
    ``directory``, with nothing half-written left. A model transformers has no class for (an option its family
    lacks) gets no config.json: Lantern reads it, transformers cannot, and the log says why.
    """
    model = unwrap(model)
    tokenizer_files = as_tokenizer_files(tokenizer_path)
    info = {
        "format": "lantern",
        "version": NATIVE_FORMAT_VERSION,
        "model": model.config.to_dict(),
        "metadata": dict(metadata or {}),
        # the tokenizer these weights go with, by the bytes of the files that map text to ids (not the chat template
        # or special-token names in tokenizer_config.json, which a user may edit): another one put in their place
        # is refused at load (trainer.checks.check_recorded_tokenizer), not read as this model's
        TOKENIZER_RECORD: {
            name: sha256_file(path) for name, path in tokenizer_files.items() if name in ("tokenizer.json", RANK_FILE)
        },
    }
    text = json.dumps(info, indent=2)  # fail on non-JSON metadata before touching the disk
    target = Path(directory)
    with atomic_directory(target, if_exists=if_exists, sources=sources) as tmp:
        not_transformers = write_hf_folder(model, tmp, tokenizer_path=tokenizer_files, metadata=metadata, native=True)
        for name, tensors in (extra_weights or {}).items():
            save_safetensors(tensors, tmp / name)
        (tmp / NATIVE_CONFIG).write_text(text + "\n")
    if not_transformers:
        log.warning("%s has no config.json, so transformers cannot load it (Lantern can): %s", target, not_transformers)
    return target


def write_hf_folder(
    model: Transformer,
    directory: Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    tokenizer_path: PathLike | TokenizerFiles | None = None,
    metadata: Mapping[str, Any] | None = None,
    native: bool = False,
) -> str | None:
    """The files of a Hugging Face folder, written into ``directory`` (created) inside a folder the caller builds
    with ``atomic_directory``, which owns the destination checks, the rename and a failing disk's one line naming
    the destination (``export_hf``; ``lantern export --adapter``'s ``OUT/base``; ``save_checkpoint``). Returns None,
    or, for Lantern's own folder (``native``), why config.json was left out (a config transformers cannot express;
    an export refuses it instead). A tiktoken rank file goes to ``original/`` in an export, as in Meta's Hugging
    Face repos, and stays at the top of Lantern's folder, where Lantern's reader takes it first."""
    metadata = metadata or {}
    tokenizer_files = as_tokenizer_files(tokenizer_path)
    bos, eos = metadata.get("bos_token_id"), metadata.get("eos_token_id")
    if tokenizer_files and (bos is None or eos is None):
        guessed_bos, guessed_eos = special_ids(tokenizer_files)
        bos = guessed_bos if bos is None else bos
        eos = guessed_eos if eos is None else eos
    state = native_state(model, dtype)
    weights_dtype = state["tok_embeddings.weight"].dtype
    not_transformers = None
    try:
        hf_config: dict[str, Any] | None = config_to_hf(model.config, weights_dtype, bos, eos)
    except ValueError as error:
        if not native:
            raise
        hf_config, not_transformers = None, str(error)
    hf_state = native_to_hf_state(state, model.config)
    directory.mkdir(parents=True, exist_ok=True)
    if not native:
        (directory / EXPORT_MARKER).write_text("written by lantern: `lantern convert` may replace this folder\n")
    write_hf_weights(hf_state, directory, max_shard_size)
    if hf_config is not None:
        (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if bos is not None or eos is not None:
        generation = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    copy_tokenizer_files(tokenizer_files, directory, rank_file_in_original=not native)
    return not_transformers
