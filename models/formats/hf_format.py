"""The Hugging Face folder of a supported family (models/families.py): the one table of parameter names
(``HF_NAME_MAP``), the wq/wk permutation, reading and writing the weights (sharded or not, Hugging Face's
``max_shard_size`` units) and bos/eos ids, and LoRA adapters in peft's own folder format.

Hugging Face rotates half-splits of each head where Meta and Lantern rotate interleaved pairs, so wq/wk rows (and
Qwen2's wq/wk biases, and within its head Qwen3's QK-norm weights) are permuted both ways, as transformers'
``convert_llama_weights_to_hf`` does.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.families import family_of
from models.formats.checkpoint_io import (
    WEIGHTS,
    check_state,
    read_json,
    read_safetensors,
    read_torch_weights,
    save_safetensors,
)
from models.formats.hf_config import HF_FAMILIES, config_to_hf, hf_to_config
from models.model import ModelConfig

__all__ = [
    "HF_FAMILIES",
    "HF_NAME_MAP",
    "config_to_hf",
    "hf_special_ids",
    "hf_state_to_native",
    "load_hf",
    "load_hf_config",
    "native_to_hf_adapter_state",
    "native_to_hf_state",
    "read_hf_weights",
    "read_hf_weights_as_native",
    "write_hf_adapter",
    "write_hf_weights",
]

# The one table of native <-> Hugging Face names, the same for every family. "{i}" is the layer index.
HF_NAME_MAP: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",  # + rope permute
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",  # + rope permute
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attention.wq.bias": "model.layers.{i}.self_attn.q_proj.bias",  # qkv_bias (Qwen2); + rope permute
    "layers.{i}.attention.wk.bias": "model.layers.{i}.self_attn.k_proj.bias",  # + rope permute
    "layers.{i}.attention.wv.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # qk_norm (Qwen3); + permute
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",  # + rope permute (one head)
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


@functools.cache
def _tables(architecture: str) -> tuple[list[tuple[re.Pattern[str], str]], list[tuple[re.Pattern[str], str]]]:
    """(native -> Hugging Face, Hugging Face -> native) name patterns of a family: HF_NAME_MAP with its own names."""
    names = {**HF_NAME_MAP, **family_of(architecture).hf_names}
    return [(_pattern(n), h) for n, h in names.items()], [(_pattern(h), n) for n, h in names.items()]


# Buffers some older Hugging Face checkpoints carry; recomputed from the config, so safe to drop.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_HF_QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


# ---------------------------------------------------------------------------------------------------------
# loading a folder


def load_hf_config(directory: Path) -> ModelConfig:
    return hf_to_config(read_json(directory / "config.json"), directory / "config.json")


def load_hf(directory: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(config, state with native names), the state checked against the config."""
    config = load_hf_config(directory)
    return config, read_hf_weights_as_native(directory, config, f"Hugging Face checkpoint {directory}")


def read_hf_weights_as_native(directory: Path, config: ModelConfig, source: str) -> dict[str, Tensor]:
    """The weights of a Hugging Face folder under native names, checked against ``config`` (config.json's, or
    lantern.json's for Lantern's own folder)."""
    return hf_state_to_native(read_hf_weights(directory), config, source)


def read_hf_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of a Hugging Face folder, under their Hugging Face names."""
    indexes = (
        ("model.safetensors.index.json", read_safetensors),
        ("pytorch_model.bin.index.json", read_torch_weights),
    )
    for index_name, reader in indexes:
        index_path = directory / index_name
        if index_path.is_file():
            files = sorted(set(read_json(index_path)["weight_map"].values()))
            state: dict[str, Tensor] = {}
            for filename in files:
                state.update(reader(directory / filename))
            return state
    if (directory / WEIGHTS).is_file():
        return read_safetensors(directory / WEIGHTS)
    if (directory / "pytorch_model.bin").is_file():
        return read_torch_weights(directory / "pytorch_model.bin")
    raise FileNotFoundError(
        f"{directory}: config.json found but no weights; expected model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json"
    )


def hf_special_ids(directory: Path) -> dict[str, Any]:
    """bos/eos ids of a Hugging Face folder (generation_config.json wins over config.json), for metadata."""
    ids: dict[str, Any] = {}
    for name in ("config.json", "generation_config.json"):
        if (directory / name).is_file():
            values = read_json(directory / name)
            ids.update({k: values[k] for k in ("bos_token_id", "eos_token_id") if values.get(k) is not None})
    return ids


# ---------------------------------------------------------------------------------------------------------
# configs


# ---------------------------------------------------------------------------------------------------------
# name mapping and RoPE permutation


_Q = ("attention.wq.weight", "attention.wq.bias")
_K = ("attention.wk.weight", "attention.wk.bias")
_QK_NORM = ("attention.q_norm.weight", "attention.k_norm.weight")  # one head's width: permuted as one head


def _heads_permuted(name: str, config: ModelConfig) -> int | None:
    """How many heads of rows the RoPE permutation of parameter ``name`` spans (None: not permuted)."""
    if name.endswith(_Q):
        return config.n_heads
    if name.endswith(_K):
        return config.n_kv_heads
    return 1 if name.endswith(_QK_NORM) else None


def native_to_hf_state(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face names and wq/wk layout; the export of a model without ``qkv_bias`` to a family that always has
    them (Qwen2) gets zero q/k/v biases (zeros compute the same)."""
    out = {}
    zero_biases = family_of(config.hf_architecture).qkv_bias and not config.qkv_bias
    for name, tensor in state.items():
        if (heads := _heads_permuted(name, config)) is not None:
            tensor = _permute_to_hf(tensor, heads)
        hf_name = _rename(name, _tables(config.hf_architecture)[0])
        if hf_name is None:
            raise ValueError(f"no Hugging Face name for parameter {name!r}")
        out[hf_name] = tensor.contiguous()
        if zero_biases and name.endswith("attention.wv.weight"):
            for projection in ("q", "k", "v"):
                width = state[name.replace("wv.weight", f"w{projection}.weight")].shape[0]
                bias_name = hf_name.replace("v_proj.weight", f"{projection}_proj.bias")
                out[bias_name] = torch.zeros(width, dtype=tensor.dtype, device=tensor.device)
    return out


# peft's names for a LoRA pair on Lantern's layers (``layers.0.attention.wq.lora_B.default.weight``) and in its files
_LORA_NAME = re.compile(r"^(?P<module>.+)\.(?P<side>lora_[AB])(?:\.[^.]+)?\.weight$")
PEFT_PREFIX = "base_model.model."  # what peft's PeftModel puts before the wrapped model's names


def native_to_hf_adapter_state(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """LoRA tensors under peft's names on Lantern's layers as peft writes them for Hugging Face's Llama:
    ``layers.0.attention.wq.lora_B.default.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight``.
    The rows of a q/k adapter's B are its layer's output rows, so B is permuted as wq/wk are; A (inputs) is not."""
    out = {}
    for name, tensor in state.items():
        match = _LORA_NAME.match(name)
        hf_name = _rename(f"{match['module']}.weight", _tables(config.hf_architecture)[0]) if match else None
        if hf_name is None:
            raise ValueError(f"no Hugging Face name for adapter tensor {name!r}")
        if match["side"] == "lora_B" and match["module"].endswith("attention.wq"):
            tensor = _permute_to_hf(tensor, config.n_heads)
        elif match["side"] == "lora_B" and match["module"].endswith("attention.wk"):
            tensor = _permute_to_hf(tensor, config.n_kv_heads)
        out[f"{PEFT_PREFIX}{hf_name.removesuffix('.weight')}.{match['side']}.weight"] = (
            tensor.detach().cpu().contiguous()
        )
    return out


def write_hf_adapter(state: dict[str, Tensor], lora: Any, directory: Path) -> None:
    """peft's adapter folder: ``adapter_config.json`` (``lora``, a peft ``LoraConfig`` naming Hugging Face's
    modules, written by peft) and ``adapter_model.safetensors`` (``state``: ``native_to_hf_adapter_state``'s)."""
    directory.mkdir(parents=True, exist_ok=True)
    lora.save_pretrained(str(directory))
    save_safetensors(state, directory / "adapter_model.safetensors")


def hf_state_to_native(state: dict[str, Tensor], config: ModelConfig, source: str) -> dict[str, Tensor]:
    """Native names and wq/wk layout, checked against ``config``; the zero q/k/v biases ``native_to_hf_state`` gives
    a model without them in a family that always has them are dropped again."""
    out: dict[str, Tensor] = {}
    zero_biases = family_of(config.hf_architecture).qkv_bias and not config.qkv_bias
    for name, tensor in state.items():
        if _HF_IGNORED.search(name):
            continue
        if zero_biases and name.endswith(_HF_QKV_BIASES) and not tensor.any():
            continue
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # tied: transformers itself ignores a stored lm_head and uses embed_tokens
        native = _rename(name, _tables(config.hf_architecture)[1])
        if native is not None and native.endswith(".bias") and not config.qkv_bias:
            native = None  # reported under its own name: this family has no such bias
        out[native if native is not None else f"<unmapped Hugging Face key> {name}"] = tensor
    check_state(out, config, source)  # before permuting: a wrong shape would make the view below fail
    for name in out:
        if (heads := _heads_permuted(name, config)) is not None:
            out[name] = _permute_from_hf(out[name], heads)
    return out


def _rename(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.groupdict().get("i") or "")
    return None


def _permute_to_hf(w: Tensor, n_heads: int) -> Tensor:
    """Interleaved-pair rows (Meta) -> half-split rows (HF): transformers' convert_llama_weights_to_hf permute.
    ``w`` is a weight (rows, dim) or a bias (rows,); rows = n_heads · head_dim."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _permute_from_hf(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of _permute_to_hf."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------------------
# writing weights


def write_hf_weights(state: dict[str, Tensor], directory: Path, max_shard_size: int | str | None) -> None:
    """model.safetensors, or Hugging Face's sharded layout (model-0000K-of-0000N.safetensors + index)."""
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    if limit is None or sum(sizes.values()) <= limit:
        save_safetensors(state, directory / WEIGHTS)
        return
    shards: list[dict[str, Tensor]] = [{}]
    used = 0
    for name, tensor in state.items():
        if shards[-1] and used + sizes[name] > limit:  # an oversized tensor gets a shard of its own
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += sizes[name]
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        filename = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, directory / filename)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot parse shard size {size!r}; use bytes or e.g. '500MB', '5GB', '2GiB'")
    unit = (match.group(2) or "B").upper()
    powers = {
        "B": 1,
        "KB": 1e3,
        "MB": 1e6,
        "GB": 1e9,
        "TB": 1e12,  # decimal, as Hugging Face's max_shard_size
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    return int(float(match.group(1)) * powers[unit])
