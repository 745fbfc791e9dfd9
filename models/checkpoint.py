"""Checkpoint interop: Lantern's native folder, Hugging Face Llama folders and Meta's consolidated.*.pth.

Three on-disk formats, one in-memory model (``models.model.Transformer``, whose parameter names are Meta's):

* **native** -- ``lantern.json`` (format, version, ``ModelConfig.to_dict()``, free-form metadata) +
  ``model.safetensors`` (+ ``tokenizer.model``). Tied models store only ``tok_embeddings.weight``.
* **hf** -- ``config.json`` (``LlamaForCausalLM``) + ``model.safetensors`` / sharded ``*.index.json`` /
  ``pytorch_model.bin``. Names differ (one table, ``HF_NAME_MAP``) and wq/wk are permuted: Hugging Face
  rotates half-splits of each head, Meta (and we) rotate interleaved pairs.
* **meta** -- ``params.json`` + ``consolidated.NN.pth`` model-parallel shards, merged here.

Safety rules: weights are read only with safetensors or ``torch.load(weights_only=True)`` (never arbitrary
pickles); every missing / unexpected / mis-shaped tensor is reported at once in one ``ValueError``; folders are
written to a hidden sibling temp dir, fsynced and renamed into place, so a crash mid-save never leaves a
half-written checkpoint where a good one was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from pickle import UnpicklingError  # only the exception: nothing here unpickles
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.atomic import EXPORT_MARKER, IfExists, atomic_directory, check_destination
from models.errors import CheckpointError
from models.model import ModelConfig, RopeScaling, Transformer

__all__ = [
    "FORMATS",
    "HF_NAME_MAP",
    "convert",
    "detect_format",
    "export_hf",
    "load_checkpoint",
    "load_model_config",
    "save_checkpoint",
]

FORMATS = ("native", "hf", "meta")
NATIVE_FORMAT_VERSION = 1
NATIVE_CONFIG = "lantern.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.model"

PathLike = str | os.PathLike

# The one table of native <-> Hugging Face names. "{i}" is the layer index.
HF_NAME_MAP: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",  # + rope permute
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",  # + rope permute
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_NATIVE_TO_HF = [(_pattern(native), hf) for native, hf in HF_NAME_MAP.items()]
_HF_TO_NATIVE = [(_pattern(hf), native) for native, hf in HF_NAME_MAP.items()]

# Buffers some older Hugging Face / Meta checkpoints carry; recomputed from the config, so safe to drop.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
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


# ---------------------------------------------------------------------------------------------------------
# small helpers


def read_torch_file(path: Path, *, mmap: bool = False) -> Any:
    """The only torch.load in this module: weights_only=True, so a checkpoint can never run code. Failures are
    one line naming the file; torch's own message (which advises ``weights_only=False``, i.e. running the
    file's code) is never passed on."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except UnpicklingError as error:
        text = str(error)
        if "Weights only load failed" in text:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            what = f" (it references {found.group(1)})" if found else ""
            raise CheckpointError(
                f"{path}: refused: the file is a pickle of Python objects, not only tensors{what}; "
                "loading it could run arbitrary code"
            ) from None
        raise CheckpointError(
            f"{path}: not a torch checkpoint (truncated or corrupt: {text.splitlines()[0]})"
        ) from None
    except (RuntimeError, EOFError, ValueError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{path}: truncated or corrupt torch checkpoint ({first})") from None


def _torch_load(path: Path, *, mmap: bool = False) -> dict[str, Tensor]:
    state = read_torch_file(path, mmap=mmap)
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    return dict(state)


def read_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(path)
    except SafetensorError as error:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({error})") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _listed(names: list[str], limit: int = 8) -> str:
    """A key list short enough for one line (a wrong-model checkpoint can miss hundreds)."""
    shown = repr(names[:limit])
    return shown if len(names) <= limit else f"{shown[:-1]}, ... {len(names) - limit} more]"


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unwrap(model: nn.Module) -> Transformer:
    """The Transformer inside torch.compile's wrapper or a LightningModule holding it as ``.model``."""
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, Transformer) and isinstance(getattr(model, "model", None), nn.Module):
        model = getattr(model.model, "_orig_mod", model.model)
    if not isinstance(model, Transformer):
        raise TypeError(f"expected a models.model.Transformer, got {type(model).__name__}")
    return model


def _native_state(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
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


def _expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = Transformer(config)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    if config.tie_embeddings:
        del shapes["output.weight"]
    return shapes


def _check_state(state: Mapping[str, Tensor], config: ModelConfig, source: str) -> None:
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


def _build_model(
    config: ModelConfig, state: dict[str, Tensor], source: str, device: torch.device | str, dtype: torch.dtype | None
) -> Transformer:
    """Check ``state`` (native names) against ``config`` and build the model without a random init.

    dtype None keeps the checkpoint's dtype (that of tok_embeddings.weight, like transformers' dtype="auto").
    """
    _check_state(state, config, source)
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


def _find_tokenizer(directory: Path) -> Path | None:
    for candidate in (directory / TOKENIZER, directory / "original" / TOKENIZER):
        if candidate.is_file():
            return candidate
    return None


def _save_safetensors(state: dict[str, Tensor], path: Path) -> None:
    # "format": "pt" is the metadata transformers checks for before it trusts a safetensors file.
    save_file(state, str(path), metadata={"format": "pt"})


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
        "model.safetensors.index.json or pytorch_model.bin (Hugging Face Llama); "
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
    return fmt


def load_model_config(path: PathLike, *, format: str = "auto") -> ModelConfig:
    """The ModelConfig of a native, Hugging Face or Meta checkpoint, without loading its weights."""
    directory = _checkpoint_dir(path)
    fmt = _resolve_format(directory, format)
    if fmt == "native":
        return _native_config(directory)
    if fmt == "hf":
        return _hf_to_config(_read_json(directory / "config.json"), directory / "config.json")
    meta_dir = _meta_dir(directory)
    shards = _meta_shard_paths(meta_dir)
    peek = _torch_load(shards[0], mmap=True)  # mmap: only the tensor headers are read
    return _meta_to_config(_read_json(meta_dir / "params.json"), peek, len(shards))


def _native_config(directory: Path) -> ModelConfig:
    info = _read_json(directory / NATIVE_CONFIG)
    if info.get("format") != "lantern":
        raise CheckpointError(f"{directory / NATIVE_CONFIG}: format is {info.get('format')!r}, expected 'lantern'")
    if info.get("version") != NATIVE_FORMAT_VERSION:
        raise ValueError(
            f"{directory / NATIVE_CONFIG}: version {info.get('version')!r} is not supported "
            f"(this code reads version {NATIVE_FORMAT_VERSION})"
        )
    if not isinstance(info.get("model"), dict):
        raise CheckpointError(f"{directory / NATIVE_CONFIG}: no 'model' section: not a Lantern checkpoint")
    try:
        return ModelConfig.from_dict(info["model"])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{directory / NATIVE_CONFIG}: invalid model config: {error}") from None


def _hf_to_config(hf: dict[str, Any], source: Path) -> ModelConfig:
    """Map a Hugging Face LlamaConfig dict to ModelConfig; refuse what the native model cannot represent."""
    problems = []
    architectures = hf.get("architectures") or []
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in architectures:
        problems.append(f"model_type {hf.get('model_type')!r} / architectures {architectures} is not Llama")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=true (the native model has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only silu / SwiGLU is supported)")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // n_heads):
        problems.append(f"head_dim={hf['head_dim']} differs from hidden_size / num_attention_heads = {dim // n_heads}")

    # RoPE: transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; 4.x wrote top-level rope_theta
    # and rope_scaling {rope_type or type, ...} (None when unscaled). Accept both.
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        problems.append("per-layer-type rope_parameters are not supported")
        params = {}
    rope = params if ("rope_type" in params or "type" in params) else legacy
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))  # 10000: LlamaConfig's default
    rope_scaling = None
    if rope_type == "llama3":
        rope_scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r} (only 'default' and 'llama3' are supported)")
    if problems:
        raise ValueError(f"{source}: unsupported Hugging Face config:\n  " + "\n  ".join(problems))
    return ModelConfig(
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        vocab_size=hf["vocab_size"],
        ffn_hidden_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # LlamaConfig's defaults for absent keys
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _config_to_hf(config: ModelConfig, dtype: torch.dtype, bos: int | None, eos: int | list[int] | None) -> dict:
    problems = []
    if config.qk_norm:
        problems.append("qk_norm=True")
    if config.logit_softcap is not None:
        problems.append(f"logit_softcap={config.logit_softcap}")
    if problems:
        raise ValueError(f"cannot export to Hugging Face Llama, which has no {' / '.join(problems)}")
    scaling = config.rope_scaling
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_scaling = None
    if scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
        rope_parameters = {**rope_scaling, "rope_theta": config.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "rope_parameters": rope_parameters,  # read by transformers >= 5
        "rope_theta": config.rope_theta,  # read by transformers 4.x
        "rope_scaling": rope_scaling,  # read by transformers 4.x
        "dtype": _dtype_name(dtype),
        "torch_dtype": _dtype_name(dtype),  # transformers 4.x name
    }


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


def _meta_to_config(params: dict[str, Any], shard0: Mapping[str, Tensor], n_shards: int) -> ModelConfig:
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
        warnings.warn(f"params.json keys ignored by Lantern: {unknown}", stacklevel=3)
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


# ---------------------------------------------------------------------------------------------------------
# name mapping and RoPE permutation


def _permute_to_hf(w: Tensor, n_heads: int) -> Tensor:
    """Interleaved-pair rows (Meta) -> half-split rows (HF): transformers' convert_llama_weights_to_hf permute."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _permute_from_hf(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of _permute_to_hf."""
    dim1, dim2 = w.shape
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _rename(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        match = pattern.match(name)
        if match:
            return template.replace("{i}", match.groupdict().get("i") or "")
    return None


def _native_to_hf_state(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    out = {}
    for name, tensor in state.items():
        if name.endswith("attention.wq.weight"):
            tensor = _permute_to_hf(tensor, config.n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = _permute_to_hf(tensor, config.n_kv_heads)
        hf_name = _rename(name, _NATIVE_TO_HF)
        if hf_name is None:
            raise ValueError(f"no Hugging Face name for parameter {name!r}")
        out[hf_name] = tensor.contiguous()
    return out


def _hf_to_native_state(state: dict[str, Tensor], config: ModelConfig, source: str) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if _HF_IGNORED.search(name):
            continue
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # tied: transformers itself ignores a stored lm_head and uses embed_tokens
        native = _rename(name, _HF_TO_NATIVE)
        out[native if native is not None else f"<unmapped Hugging Face key> {name}"] = tensor
    _check_state(out, config, source)  # before permuting: a wrong shape would make the view below fail
    for name in out:
        if name.endswith("attention.wq.weight"):
            out[name] = _permute_from_hf(out[name], config.n_heads)
        elif name.endswith("attention.wk.weight"):
            out[name] = _permute_from_hf(out[name], config.n_kv_heads)
    return out


# ---------------------------------------------------------------------------------------------------------
# readers


def _read_hf_weights(directory: Path) -> dict[str, Tensor]:
    indexes = (("model.safetensors.index.json", read_safetensors), ("pytorch_model.bin.index.json", _torch_load))
    for index_name, reader in indexes:
        index_path = directory / index_name
        if index_path.is_file():
            files = sorted(set(_read_json(index_path)["weight_map"].values()))
            state: dict[str, Tensor] = {}
            for filename in files:
                state.update(reader(directory / filename))
            return state
    if (directory / WEIGHTS).is_file():
        return read_safetensors(directory / WEIGHTS)
    if (directory / "pytorch_model.bin").is_file():
        return _torch_load(directory / "pytorch_model.bin")
    raise FileNotFoundError(
        f"{directory}: config.json found but no weights; expected model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json"
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


def _load_native(directory: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    config = _native_config(directory)
    if not (directory / WEIGHTS).is_file():
        raise FileNotFoundError(f"{directory}: {NATIVE_CONFIG} found but no {WEIGHTS}")
    return config, read_safetensors(directory / WEIGHTS)


def _load_hf(directory: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    config = _hf_to_config(_read_json(directory / "config.json"), directory / "config.json")
    state = _hf_to_native_state(_read_hf_weights(directory), config, f"Hugging Face checkpoint {directory}")
    return config, state


def _load_meta(directory: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    directory = _meta_dir(directory)
    paths = _meta_shard_paths(directory)
    shards = [_torch_load(path) for path in paths]
    config = _meta_to_config(_read_json(directory / "params.json"), shards[0], len(shards))
    return config, _merge_meta_shards(shards, config)


_LOADERS = {"native": _load_native, "hf": _load_hf, "meta": _load_meta}


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


# ---------------------------------------------------------------------------------------------------------
# writers


def save_checkpoint(
    model: nn.Module,
    directory: PathLike,
    *,
    tokenizer_path: PathLike | None = None,
    metadata: Mapping[str, Any] | None = None,
    if_exists: IfExists = "replace-lantern",
    sources: tuple[PathLike, ...] = (),
) -> Path:
    """Write ``model`` as a native checkpoint folder, atomically.

    ``metadata`` must be JSON-serialisable (step, tokenizer ids, ...); it is stored in lantern.json.
    ``tokenizer_path`` is copied in as tokenizer.model. An existing non-empty folder is replaced only when
    Lantern wrote it (``if_exists`` "replace-lantern"), when ``if_exists`` is "replace", never with
    "refuse"; never one that contains ``sources`` (see ``models.atomic.check_destination``).
    """
    model = _unwrap(model)
    info = {
        "format": "lantern",
        "version": NATIVE_FORMAT_VERSION,
        "model": model.config.to_dict(),
        "metadata": dict(metadata or {}),
    }
    text = json.dumps(info, indent=2)  # fail on non-JSON metadata before touching the disk
    if tokenizer_path is not None and not Path(tokenizer_path).is_file():
        raise FileNotFoundError(f"tokenizer file not found: {tokenizer_path}")
    state = _native_state(model)
    target = Path(directory)
    with atomic_directory(target, if_exists=if_exists, sources=sources) as tmp:
        _save_safetensors(state, tmp / WEIGHTS)
        (tmp / NATIVE_CONFIG).write_text(text + "\n")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER)
    return target


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


def _write_hf_weights(state: dict[str, Tensor], directory: Path, max_shard_size: int | str | None) -> None:
    """model.safetensors, or Hugging Face's sharded layout (model-0000K-of-0000N.safetensors + index)."""
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    if limit is None or sum(sizes.values()) <= limit:
        _save_safetensors(state, directory / WEIGHTS)
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
        _save_safetensors(shard, directory / filename)
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _special_ids_from_tokenizer(path: Path) -> tuple[int | None, list[int] | None]:
    """bos / stop ids of a Lantern / Llama 3 tiktoken rank file: its N ranks are followed by Meta's 256 specials,
    <|begin_of_text|> = N, <|end_of_text|> = N+1, <|eom_id|> = N+8, <|eot_id|> = N+9 (see data/tokenizer.py)."""
    try:
        lines = [line for line in path.read_bytes().splitlines() if line.strip()]
        ranks = [int(line.split()[1]) for line in lines]
    except (OSError, ValueError, IndexError):
        return None, None  # not a rank file (e.g. a sentencepiece model): ids unknown
    if ranks != list(range(len(ranks))):
        return None, None
    n = len(ranks)
    return n, [n + 1, n + 8, n + 9]


def export_hf(
    model_or_checkpoint_path: nn.Module | PathLike,
    out_dir: PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str | None = None,
    tokenizer_path: PathLike | None = None,
    if_exists: IfExists = "replace-lantern",
) -> Path:
    """Write a Hugging Face LlamaForCausalLM folder (config.json, safetensors, generation_config.json), atomically.
    An existing folder is replaced as ``save_checkpoint`` says (``if_exists``).

    Accepts a Transformer or any checkpoint folder load_checkpoint reads. The tokenizer (``tokenizer_path`` or the
    checkpoint's tokenizer.model) goes to original/tokenizer.model, as in Meta's Hugging Face repos. bos/eos ids
    come from the checkpoint metadata (bos_token_id / eos_token_id) or else from that tokenizer file.
    """
    metadata: dict[str, Any] = {}
    sources: tuple[PathLike, ...] = ()
    if isinstance(model_or_checkpoint_path, nn.Module):
        model = _unwrap(model_or_checkpoint_path)
    else:
        sources = (model_or_checkpoint_path,)
        source = _checkpoint_dir(model_or_checkpoint_path)
        model = load_checkpoint(source)
        if detect_format(source) == "native":
            metadata = _read_json(source / NATIVE_CONFIG).get("metadata", {})
        if tokenizer_path is None:
            tokenizer_path = _find_tokenizer(source)
    return _export_hf(model, out_dir, _as_dtype(dtype), max_shard_size, tokenizer_path, metadata, if_exists, sources)


def _export_hf(
    model: Transformer,
    out_dir: PathLike,
    dtype: torch.dtype | None,
    max_shard_size: int | str | None,
    tokenizer_path: PathLike | None,
    metadata: Mapping[str, Any],
    if_exists: IfExists = "replace-lantern",
    sources: tuple[PathLike, ...] = (),
) -> Path:
    bos, eos = metadata.get("bos_token_id"), metadata.get("eos_token_id")
    if tokenizer_path is not None and (bos is None or eos is None):
        guessed_bos, guessed_eos = _special_ids_from_tokenizer(Path(tokenizer_path))
        bos = guessed_bos if bos is None else bos
        eos = guessed_eos if eos is None else eos
    state = _native_state(model, dtype)
    weights_dtype = state["tok_embeddings.weight"].dtype
    hf_config = _config_to_hf(model.config, weights_dtype, bos, eos)  # refuses unsupported configs first
    hf_state = _native_to_hf_state(state, model.config)
    target = Path(out_dir)
    with atomic_directory(target, if_exists=if_exists, sources=sources) as tmp:
        (tmp / EXPORT_MARKER).write_text("written by lantern: `lantern convert` may replace this folder\n")
        _write_hf_weights(hf_state, tmp, max_shard_size)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if bos is not None or eos is not None:
            generation = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer_path is not None:
            (tmp / "original").mkdir()
            shutil.copyfile(tokenizer_path, tmp / "original" / TOKENIZER)
    return target


def _hf_special_ids(directory: Path) -> dict[str, Any]:
    """bos/eos ids of a Hugging Face folder (generation_config.json wins over config.json), for metadata."""
    ids: dict[str, Any] = {}
    for name in ("config.json", "generation_config.json"):
        if (directory / name).is_file():
            values = _read_json(directory / name)
            ids.update({k: values[k] for k in ("bos_token_id", "eos_token_id") if values.get(k) is not None})
    return ids


def convert(
    src: PathLike,
    src_format: str = "auto",
    dst: PathLike | None = None,
    dst_format: str = "native",
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a checkpoint folder (hf / meta / native / auto) to a native or Hugging Face folder.

    A tokenizer.model in ``src`` or ``src/original`` travels along; Hugging Face bos/eos ids are kept in the
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
    tokenizer = _find_tokenizer(source)
    metadata: dict[str, Any] = {}
    if fmt == "native":
        metadata = _read_json(source / NATIVE_CONFIG).get("metadata", {})
    elif fmt == "hf":
        metadata = _hf_special_ids(source)
    if dst_format == "hf":
        return _export_hf(model, dst, None, max_shard_size, tokenizer, metadata, if_exists, (source,))
    metadata = {**metadata, "converted_from": {"format": fmt, "path": str(source.absolute())}}
    return save_checkpoint(
        model, dst, tokenizer_path=tokenizer, metadata=metadata, if_exists=if_exists, sources=(source,)
    )
