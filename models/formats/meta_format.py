"""Reading Meta's consolidated folder (``params.json`` + ``consolidated.NN.pth`` shards, at the top or under
``original/``): ``params.json`` as a ``ModelConfig`` and the shards merged into one state dict (Meta's names are
Lantern's). What params.json leaves to Meta's runtime is inferred: the vocabulary from the embeddings when it says
-1, tied embeddings from a missing ``output.weight``, RoPE scaling and context length per Llama generation. Lantern
never writes this format.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.formats.checkpoint_io import read_json, read_torch_weights
from models.model import ModelConfig, RopeScaling

__all__ = ["load_meta", "load_meta_config"]

# A buffer some older Meta checkpoints carry; recomputed from the config, so safe to drop.
_META_IGNORED = {"rope.freqs"}

# How Meta's model-parallel shards split each tensor (fairscale layers in Meta's reference model.py):
# ColumnParallelLinear splits the output features (dim 0), RowParallelLinear the input features (dim 1),
# norms are replicated. tok_embeddings is special-cased in _merge_meta_shards: Llama 2's ParallelEmbedding
# splits the embedding dim (dim 1), Llama 3's VocabParallelEmbedding splits the vocabulary (dim 0).
_META_SHARD_DIM: dict[str, int | None] = {
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w2.weight": 1,
    "feed_forward.w3.weight": 0,
    "output.weight": 0,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
    "norm.weight": None,
}


def load_meta_config(directory: Path) -> ModelConfig:
    """The config alone: of the shards only the first one's tensor headers are read (mmap)."""
    directory = _meta_dir(directory)
    shards = _meta_shard_paths(directory)
    peek = read_torch_weights(shards[0], mmap=True)
    # stacklevel 4: a params.json warning names the line that called load_model_config
    return _meta_to_config(read_json(directory / "params.json"), peek, len(shards), stacklevel=4)


def load_meta(directory: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(config, merged state), the state not yet checked against the config."""
    directory = _meta_dir(directory)
    paths = _meta_shard_paths(directory)
    shards = [read_torch_weights(path) for path in paths]
    # stacklevel 3: a params.json warning names load_checkpoint's line
    config = _meta_to_config(read_json(directory / "params.json"), shards[0], len(shards), stacklevel=3)
    return config, _merge_meta_shards(shards, config)


def _meta_dir(directory: Path) -> Path:
    """Hugging Face hub Llama repos keep Meta's files under original/."""
    if not (directory / "params.json").is_file() and (directory / "original" / "params.json").is_file():
        return directory / "original"
    return directory


def _meta_shard_paths(directory: Path) -> list[Path]:
    shards = sorted(directory.glob("consolidated.*.pth"))
    if not shards:
        raise FileNotFoundError(f"{directory}: params.json found but no consolidated.00.pth")
    expected = [directory / f"consolidated.{i:02d}.pth" for i in range(len(shards))]
    if shards != expected:
        raise ValueError(
            f"{directory}: model-parallel shards must be consolidated.00.pth ... "
            f"consolidated.{len(shards) - 1:02d}.pth, found {[p.name for p in shards]}"
        )
    return shards


def _meta_to_config(
    params: dict[str, Any], shard0: Mapping[str, Tensor], n_shards: int, *, stacklevel: int
) -> ModelConfig:
    """Meta params.json -> ModelConfig. Things params.json leaves to Meta's runtime are inferred here."""
    known = {
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "multiple_of",
        "ffn_dim_multiplier",
        "norm_eps",
        "rope_theta",
        "use_scaled_rope",
        "rope_scaling",
        "rope_scaling_factor",
        "max_seq_len",
        "max_batch_size",
    }
    unknown = sorted(set(params) - known)
    if unknown:
        warnings.warn(f"params.json keys ignored by Lantern: {unknown}", stacklevel=stacklevel)
    dim = params["dim"]
    # Meta 3.2 1B/3B tie the output to the embeddings and ship no output.weight.
    tied = "output.weight" not in shard0
    vocab_size = params.get("vocab_size", -1)
    if vocab_size is None or vocab_size <= 0:  # Llama 1/2 params.json say -1: the tokenizer decides
        embedding = shard0["tok_embeddings.weight"]
        # VocabParallelEmbedding splits the vocabulary, ParallelEmbedding the embedding dim (see _META_SHARD_DIM)
        vocab_size = embedding.shape[0] * (n_shards if embedding.shape[1] == dim else 1)

    rope_scaling = None
    if isinstance(params.get("rope_scaling"), dict):
        values = {k: v for k, v in params["rope_scaling"].items() if k not in ("rope_type", "type")}
        rope_scaling = RopeScaling(**values)
    elif params.get("use_scaled_rope"):
        # Meta's reference hard-codes the Llama 3.1 values (factor 8, 1, 4, 8192). Llama 3.2 1B/3B were trained
        # with factor 32 but their params.json does not say so; they are the only tied Llama 3 models, so a
        # tied checkpoint without an explicit factor gets 32 (what Hugging Face's converter uses for 3.2).
        factor = params.get("rope_scaling_factor") or (32.0 if tied else 8.0)
        rope_scaling = RopeScaling(factor=float(factor))
    return ModelConfig(
        dim=dim,
        n_layers=params["n_layers"],
        n_heads=params["n_heads"],
        n_kv_heads=params.get("n_kv_heads") or params["n_heads"],
        vocab_size=vocab_size,
        multiple_of=params.get("multiple_of", 256),
        ffn_dim_multiplier=params.get("ffn_dim_multiplier"),
        norm_eps=float(params.get("norm_eps", 1e-5)),
        # Llama 2's params.json has no rope_theta: its reference default is 10000 (Llama 3 always writes it).
        rope_theta=float(params.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        # Meta passes max_seq_len at runtime; use each generation's trained context length.
        max_seq_len=params.get("max_seq_len") or (131072 if rope_scaling is not None else 8192),
        tie_embeddings=tied,
    )


def _merge_meta_shards(shards: list[dict[str, Tensor]], config: ModelConfig) -> dict[str, Tensor]:
    if len(shards) == 1:
        return {k: v for k, v in shards[0].items() if k not in _META_IGNORED}
    merged = {}
    for name, first in shards[0].items():
        if name in _META_IGNORED:
            continue
        parts = [shard[name] for shard in shards if name in shard]
        if len(parts) != len(shards):
            raise ValueError(f"Meta shard merge: {name!r} is in only {len(parts)} of {len(shards)} shards")
        if name == "tok_embeddings.weight":
            split_dim: int | None = 0 if first.shape[1] == config.dim else 1
        else:
            split_dim = _META_SHARD_DIM.get(re.sub(r"^layers\.\d+\.", "", name))
        # Replicated (norms) and unknown tensors come from shard 0; unknown names are reported later.
        merged[name] = first if split_dim is None else torch.cat(parts, dim=split_dim)
    return merged
