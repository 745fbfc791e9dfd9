"""A Hugging Face ``config.json`` of a supported family (models/families.py) <-> ``ModelConfig``, transformers 4.x and 5
alike. The family is kept in ``ModelConfig.hf_architecture`` (an import exports back as the same family) and turns on
its block options (Qwen2's q/k/v biases, Qwen3's QK norm); an explicit ``head_dim`` is ``head_dim_override``, RoPE
types default / linear / llama3 are ``rope_scaling``. Anything else (other architectures, other biases, activations
or RoPE types, a sliding window shorter than the context) is refused in one line listing every problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.errors import CheckpointError
from models.families import BLOCK_OPTIONS, FAMILIES, HF_ARCHITECTURES, REFUSED_ARCHITECTURES, Family, family_of
from models.model import ModelConfig, RopeScaling

__all__ = ["HF_FAMILIES", "config_to_hf", "hf_to_config"]

# The supported architectures and their config.json model_type (ModelConfig.hf_architecture is one of them).
HF_FAMILIES = {family.hf_architecture: family.hf_model_type for family in FAMILIES}


def hf_to_config(hf: dict[str, Any], source: Path) -> ModelConfig:
    """Map a Hugging Face config dict of a supported family to ModelConfig; refuse, in one line listing every
    problem, what the native model cannot represent."""
    family = _family(hf, source)
    architecture = family.hf_architecture
    missing = [key for key in _REQUIRED if key not in hf]
    if missing:
        raise CheckpointError(f"{source}: {architecture} config without {', '.join(missing)}")
    problems = []
    if hf.get("attention_bias") and not family.qkv_bias:
        problems.append("attention_bias=true (an o_proj bias is not supported; only Qwen2's q/k/v biases are)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true (the MLP has no biases)")
    hf, values, family_problems = family.read(hf)  # the family's own keys; its global RoPE stated as Llama's
    problems += family_problems
    max_seq_len = hf.get("max_position_embeddings", family.default_context)
    rope_theta, rope_scaling, rope_problem = _rope(hf)
    problems += [p for p in (rope_problem, _sliding_window_problem(hf, family, max_seq_len)) if p]
    if problems:
        raise CheckpointError(f"{source}: unsupported {architecture} config: " + "; ".join(problems))
    try:
        return _model_config(hf, family, rope_theta, rope_scaling, max_seq_len, values)
    except ValueError as error:  # e.g. an odd head_dim: ModelConfig's own check, named with the file
        raise CheckpointError(f"{source}: {error}") from None


def _model_config(
    hf: dict[str, Any],
    family: Family,
    rope_theta: float,
    rope_scaling: RopeScaling | None,
    max_seq_len: int,
    values: dict[str, Any],
) -> ModelConfig:
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim_override=hf.get("head_dim"),  # None or dim // n_heads: derived
        vocab_size=hf["vocab_size"],
        ffn_hidden_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # the transformers configs' defaults for absent keys
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_seq_len=max_seq_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias,
        hf_architecture=family.hf_architecture,
        **family.block,
        **values,
    )


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


def _family(hf: dict[str, Any], source: Path) -> Family:
    """The supported family config.json names (its architectures, else its model_type), or a one-line refusal."""
    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for name in architectures:
        if name in HF_ARCHITECTURES:
            return family_of(name)
    if not architectures:
        for family in FAMILIES:
            if model_type == family.hf_model_type:
                return family
    named = f"{architectures[0]!r} (model_type {model_type!r})" if architectures else f"model_type {model_type!r}"
    reason = next((REFUSED_ARCHITECTURES[name] for name in architectures if name in REFUSED_ARCHITECTURES), None)
    supported = f"supported: {', '.join(HF_ARCHITECTURES)}"
    raise CheckpointError(
        f"{source}: architecture {named} is not supported ({f'{reason}; ' if reason else ''}{supported})"
    )


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None, str | None]:
    """(rope_theta, rope_scaling, problem). transformers 5 writes rope_parameters {rope_type, rope_theta, ...};
    4.x wrote top-level rope_theta and rope_scaling {rope_type or type, ...} (None when unscaled). Both are read."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        return 10000.0, None, "per-layer-type rope_parameters are not supported"
    rope = params if ("rope_type" in params or "type" in params) else legacy
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))  # 10000: the config classes' default
    if rope_type == "default":
        return rope_theta, None, None
    if rope_type == "linear":
        return rope_theta, RopeScaling(factor=float(rope["factor"]), rope_type="linear"), None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
        return rope_theta, scaling, None
    return rope_theta, None, f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)"


def _sliding_window_problem(hf: dict[str, Any], family: Family, max_seq_len: int) -> str | None:
    """A sliding window shorter than the context on some layer (models/families.py says which layers the family's
    config.json windows) is attention the model lacks."""
    window = hf.get("sliding_window")
    if not family.windowed(hf) or window is None or window >= max_seq_len:
        return None
    return (
        f"sliding_window={window} < max_position_embeddings={max_seq_len}: sliding-window attention is not implemented"
    )


def config_to_hf(config: ModelConfig, dtype: torch.dtype, bos: int | None, eos: int | list[int] | None) -> dict:
    """The config.json of ``config.hf_architecture``'s family, for transformers 4.x and 5."""
    architecture = config.hf_architecture
    family = family_of(architecture)
    with_bias = [f.hf_architecture for f in FAMILIES if f.qkv_bias]
    problems = []
    for key, off in BLOCK_OPTIONS.items():  # an option another family has (the family's own are always on)
        if getattr(config, key) != family.block.get(key, off):
            having = [f.hf_architecture for f in FAMILIES if f.block.get(key, off) == getattr(config, key)]
            problems.append(f"{key}={getattr(config, key)!r} (export as hf_architecture {' or '.join(having)})")
    if config.logit_softcap is not None and not family.softcap:
        problems.append(f"logit_softcap={config.logit_softcap}")
    if config.sliding_window is not None and not family.sliding_layers:
        problems.append(f"sliding_window={config.sliding_window} (sliding-window layers)")
    if config.qkv_bias and not family.qkv_bias:
        problems.append(f"qkv_bias=True (q/k/v-only biases: export as hf_architecture {' or '.join(with_bias)})")
    if problems:  # (a family's own options are on in every ModelConfig of it: its check)
        raise ValueError(f"cannot export to Hugging Face {architecture}, which has no {' / '.join(problems)}")
    scaling = config.rope_scaling
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_scaling: dict[str, Any] | None = None
    if scaling is not None and scaling.rope_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": scaling.factor}
    elif scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    if rope_scaling is not None:
        rope_parameters = {**rope_scaling, "rope_theta": config.rope_theta}
    dtype_name = str(dtype).removeprefix("torch.")
    values: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": family.hf_model_type,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "rope_parameters": rope_parameters,  # read by transformers >= 5
        "rope_theta": config.rope_theta,  # read by transformers 4.x
        "rope_scaling": rope_scaling,  # read by transformers 4.x
        "dtype": dtype_name,
        "torch_dtype": dtype_name,  # transformers 4.x name
    }
    values.update(family.hf_keys(config))
    if not family.states_head_dim and config.head_dim_override is None:
        del values["head_dim"]  # read only when it is not the derived one
    return values
