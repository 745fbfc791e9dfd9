"""GGUF files (llama.cpp's single-file format) to and from Lantern's model: read (dequantized), convert to a native or
Hugging Face folder, and write (f32 / f16 / bf16) as llama.cpp's ``convert_hf_to_gguf.py`` does. Each family has the
GGUF architecture its record in models/families.py names ("llama" for Llama and Mistral, "qwen2", "qwen3")."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy
import torch
from torch import Tensor, nn

from models.errors import LanternError
from models.families import FAMILIES, family_of
from models.files.atomic import IfExists, check_destination, write_file_atomically
from models.formats.gguf_reader import parsed_once
from models.formats.gguf_tokenizer import (
    GENERATION_CONFIG,
    add_tokenizer_fields,
    gguf_tokenizer_fields,
    write_gguf_tokenizer_files,
)
from models.formats.hf_config import config_to_hf, hf_to_config
from models.formats.hf_format import hf_state_to_native, native_to_hf_state
from models.formats.native_folder import native_state, unwrap
from models.model import ModelConfig, Transformer, rope_frequencies

__all__ = [
    "GGUF_DTYPES",
    "check_gguf_destination",
    "convert_gguf",
    "load_gguf",
    "read_gguf",
    "read_gguf_config",
    "write_gguf",
]

GGUF_DTYPES = ("f32", "f16", "bf16")
LANTERN_ROPE_KEY = "lantern.rope_scaling"
GGUF_ARCHITECTURES = tuple(dict.fromkeys(family.gguf_architecture for family in FAMILIES))  # those read


# ---------------------------------------------------------------------------------------------------------
# reading


def _check_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise LanternError(f"GGUF file not found: {path}")
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise LanternError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    return path


def _field_value(field: Any) -> Any:
    """A scalar or string metadata value of a ``gguf.GGUFReader`` field (arrays: their length)."""
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        return len(field.data)
    value = field.parts[field.data[0]]
    return bytes(value).decode("utf-8") if kind == GGUFValueType.STRING else value.tolist()[0]


def gguf_fields(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF file's metadata (an array field: its length), read once per version of the file."""
    return _read_metadata(Path(path))[0]


def _read_metadata(path: Path) -> tuple[dict[str, Any], dict[str, str], Tensor | None]:
    """(metadata, {tensor name: ggml type}, the rope_freqs tensor if any), through gguf's reader; cached by the
    file's size and mtime, since a command reads it for its check, its tokenizer and its weights."""
    stat = path.stat()
    return _metadata_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns, str(path))


@functools.lru_cache(maxsize=8)
def _metadata_of(
    resolved: str, size: int, mtime_ns: int, shown: str
) -> tuple[dict[str, Any], dict[str, str], Tensor | None]:
    from gguf import GGUFReader

    path = Path(shown)

    try:
        reader = GGUFReader(resolved)
    except (ValueError, OSError, IndexError, struct.error) as error:  # a truncated or damaged file
        raise LanternError(f"{path}: cannot read it as GGUF, truncated or damaged ({error})") from None
    fields = {name: _field_value(field) for name, field in reader.fields.items()}
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    rope_freqs = next((torch.tensor(t.data.copy()) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return fields, types, rope_freqs


def _rope_scaling(path: Path, fields: Mapping[str, Any], rope_freqs: Tensor | None, hf: dict) -> dict | None:
    """The Hugging Face rope_scaling dict a GGUF states (see the module's choices), or None."""
    if LANTERN_ROPE_KEY in fields:
        values = json.loads(fields[LANTERN_ROPE_KEY])
        return {**values, "rope_type": values.get("rope_type", "llama3")}
    architecture = fields.get("general.architecture")
    kind = fields.get(f"{architecture}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(fields[f"{architecture}.rope.scaling.factor"])}
    if kind not in (None, "none"):
        raise LanternError(f"{path}: RoPE scaling {kind!r} is not supported (Llama 3.1's and linear are)")
    if rope_freqs is None:
        return None
    guess = {
        "rope_type": "llama3",
        "factor": float(rope_freqs.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = hf_to_config(_with_scaling(hf, guess), path)
    if not torch.allclose(_rope_divisors(config), rope_freqs.float().flatten(), rtol=1e-4):
        raise LanternError(f"{path}: its rope_freqs tensor is not Llama 3.1's RoPE scaling; it cannot be read")
    return guess


def _with_scaling(hf: dict, scaling: dict) -> dict:
    """``hf`` with RoPE scaling, as transformers 5 (rope_parameters) and 4.x (rope_scaling) both state it."""
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    return {**hf, "rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": theta}}


def _check_architecture(path: Path, fields: Mapping[str, Any]) -> None:
    architecture = fields.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        supported = ", ".join(map(repr, GGUF_ARCHITECTURES))
        raise LanternError(f"{path}: GGUF architecture {architecture!r} is not supported; Lantern reads {supported}")


def _read_with(auto_class: Any, path: Path, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained`` of a GGUF file (transformers' GGUF reader), its failure as one line."""
    try:
        return auto_class.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True, **kwargs)
    except (ValueError, NotImplementedError, KeyError, OSError) as error:
        raise LanternError(f"{path}: transformers cannot read it ({' '.join(str(error).split())})") from None


def _transformers_config(path: Path, fields: Mapping[str, Any]) -> Any:
    """transformers' config of a GGUF file, with the head width its GGUF loader leaves at the family's default for
    some architectures (Qwen3's) taken from the file's own key_length."""
    from transformers import AutoConfig

    config = _read_with(AutoConfig, path)
    key_length = fields.get(f"{fields.get('general.architecture')}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    return config


def _model_config(path: Path, fields: Mapping[str, Any], rope_freqs: Tensor | None, loaded: dict) -> ModelConfig:
    """The ModelConfig of transformers' config dict for a GGUF file, with what its GGUF loader leaves out."""
    hf = {k: v for k, v in loaded.items() if not k.startswith("_")}
    if "rms_norm_eps" in hf:  # stored as float32: back to its shortest decimal (1e-05, not 9.999999747378752e-06)
        hf["rms_norm_eps"] = float(str(numpy.float32(hf["rms_norm_eps"])))
    scaling = _rope_scaling(path, fields, rope_freqs, hf)  # transformers' GGUF loader reads none for "llama"
    if scaling is not None:
        hf = _with_scaling(hf, scaling)
    return hf_to_config(hf, path)


def check_gguf_file(path: str | os.PathLike) -> None:
    """Refuse, in one line naming the file, one that gguf's reader cannot read (truncated, damaged, not GGUF) or of
    an architecture Lantern does not read: before transformers' own GGUF parser, whose errors name neither."""
    path = _check_file(path)
    _check_architecture(path, _read_metadata(path)[0])


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a GGUF file of a supported family from its metadata alone (no tensor is dequantized)."""
    path = _check_file(path)
    stat = path.stat()
    # transformers parses every metadata array (the vocabulary) to read a config: ~10 s on 2 cores for SmolLM2, and a
    # continued-pretraining run reads it at load, in the tokenizer check and before training
    return dataclasses.replace(_gguf_config(str(path.resolve()), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
@parsed_once
def _gguf_config(path: str, size: int, mtime_ns: int) -> ModelConfig:
    path = Path(path)
    fields, _, rope_freqs = _read_metadata(path)
    _check_architecture(path, fields)
    return _model_config(path, fields, rope_freqs, _transformers_config(path, fields).to_dict())


@parsed_once
def read_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, Tensor], dict[str, Any]]:
    """(config, state with native names in ``dtype``, info) of a GGUF file of a supported family, every ggml type dequantized by
    transformers' GGUF loader. info: name, tensor_types ({ggml type: count}), bos/eos/pad_token_id, chat_template
    (bool), the tokenizer model and pre-tokenizer names."""
    from transformers import AutoModelForCausalLM

    path = _check_file(path)
    fields, types, rope_freqs = _read_metadata(path)
    _check_architecture(path, fields)
    loaded, report = _read_with(
        AutoModelForCausalLM, path, config=_transformers_config(path, fields), output_loading_info=True
    )
    unread = sorted({*report.get("missing_keys", ()), *(key for key, *_ in report.get("mismatched_keys", ()))})
    if unread:  # transformers initialises these at random and goes on: a model that is not the file's
        shown = ", ".join(unread[:4]) + (f", ... {len(unread) - 4} more" if len(unread) > 4 else "")
        raise LanternError(f"{path}: transformers' GGUF reader cannot fill {len(unread)} weights ({shown})")
    config = _model_config(path, fields, rope_freqs, loaded.config.to_dict())
    tensors = {name: tensor.detach().to(dtype) for name, tensor in loaded.state_dict().items()}
    del loaded
    state = hf_state_to_native(tensors, config, f"GGUF file {path}")
    info = {
        "name": fields.get("general.name"),
        "tensor_types": dict(Counter(types.values())),
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
        "chat_template": "tokenizer.chat_template" in fields,
        "tokenizer": {"model": fields.get("tokenizer.ggml.model"), "pre": fields.get("tokenizer.ggml.pre")},
    }
    return config, state, info


def load_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[Transformer, dict[str, Any]]:
    """(model, info): ``read_gguf``'s config and state built into a Transformer."""
    from models.formats.checkpoint import _build_model

    config, state, info = read_gguf(path, dtype)
    return _build_model(config, state, f"GGUF file {path}", device, dtype), info


@parsed_once
def convert_gguf(
    src_file: str | os.PathLike,
    dst: str | os.PathLike,
    dst_format: Literal["native", "hf"] = "native",
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a GGUF file as a native or Hugging Face folder, atomically, with its tokenizer as Hugging Face files
    (tokenizer.json, tokenizer_config.json with the chat template; generation_config.json). ``dtype`` None: float32.
    A non-empty ``dst`` is refused unless ``overwrite``; the GGUF's bos/eos ids go to the native metadata (an export
    writes those its tokenizer files name into config.json)."""
    from models.formats.checkpoint import export_hf, save_checkpoint

    if dst_format not in ("native", "hf"):
        raise ValueError(f"unknown destination format {dst_format!r}; expected 'native' or 'hf'")
    source = _check_file(src_file)
    if_exists: IfExists = "replace" if overwrite else "refuse"
    check_destination(dst, if_exists=if_exists, sources=(source,))  # before the slow part
    model, info = load_gguf(source, dtype or torch.float32)
    with tempfile.TemporaryDirectory(prefix="lantern-gguf-tokenizer-") as scratch:
        files = {path.name: path for path in write_gguf_tokenizer_files(source, scratch)}
        if dst_format == "hf":
            files.pop(GENERATION_CONFIG, None)  # export_hf writes its own, from the same ids
            return export_hf(model, dst, tokenizer_path=files, if_exists=if_exists)
        ids = {k: info[k] for k in ("bos_token_id", "eos_token_id") if info[k] is not None}
        origin = {"format": "gguf", "path": str(source.absolute()), "name": info["name"]}
        metadata = {**ids, "converted_from": origin}
        return save_checkpoint(
            model, dst, tokenizer_path=files, metadata=metadata, if_exists=if_exists, sources=(source,)
        )


# ---------------------------------------------------------------------------------------------------------
# writing


def _rope_divisors(config: ModelConfig) -> Tensor:
    """llama.cpp's rope_freqs: what each unscaled inverse frequency is divided by under ``config.rope_scaling``."""
    unscaled = rope_frequencies(dataclasses.replace(config, rope_scaling=None))
    return (unscaled.double() / rope_frequencies(config).double()).float()


def _llama_cpp_permute(weight: Tensor, n_heads: int) -> Tensor:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: Hugging Face's rotate-half rows -> interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_array(tensor: Tensor, dtype: str) -> tuple[Any, Any]:
    """(numpy array, raw ggml type or None) as GGUFWriter.add_tensor takes them; 1-D tensors stay f32."""
    from gguf import GGMLQuantizationType

    tensor = tensor.detach().cpu()
    if tensor.dim() <= 1 or dtype == "f32":
        return tensor.float().contiguous().numpy(), None
    if dtype == "f16":
        return tensor.half().contiguous().numpy(), None
    return tensor.bfloat16().contiguous().view(torch.int16).numpy(), GGMLQuantizationType.BF16


def check_gguf_destination(
    out_file: str | os.PathLike, *, overwrite: bool = False, sources: tuple[str | os.PathLike, ...] = ()
) -> Path:
    """Where a GGUF file may be written: not a folder, not a source being read, an existing file only with
    ``overwrite`` (one-line FileExistsError / LanternError, before anything slow)."""
    out = Path(out_file)
    if out.is_dir():
        raise LanternError(f"refusing to write GGUF file {out}: it is a folder")
    if any(out.resolve() == Path(source).resolve() for source in sources):
        raise FileExistsError(f"refusing to write {out}: it is the source; pick another file")
    if out.exists() and not overwrite:
        raise FileExistsError(f"refusing to replace {out}: it exists; pass --overwrite to replace it")
    return out


def write_gguf(
    model: nn.Module,
    out_file: str | os.PathLike,
    tokenizer_folder: str | os.PathLike,
    *,
    dtype: Literal["f32", "f16", "bf16"] = "f16",
    name: str | None = None,
    metadata: Mapping[str, str | int | float | bool] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (a Transformer, compiled or inside a LightningModule) as a GGUF file of its family's
    architecture, with the tokenizer
    of ``tokenizer_folder`` (its tokenizer.json + tokenizer_config.json), atomically. ``metadata``: extra keys
    (e.g. ``{"general.description": ...}``). An existing file is replaced only with ``overwrite``."""
    from gguf import MODEL_ARCH_NAMES, GGUFWriter, LlamaFileType, RopeScalingType, get_tensor_name_map

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"unknown GGUF dtype {dtype!r}; expected one of {GGUF_DTYPES}")
    out = check_gguf_destination(out_file, overwrite=overwrite)
    model = unwrap(model)
    config = model.config
    family = family_of(config.hf_architecture)
    architecture = family.gguf_architecture
    fields = gguf_tokenizer_fields(tokenizer_folder, vocab_size=config.vocab_size)
    try:
        hf = config_to_hf(config, torch.float32, fields["bos_id"], fields["eos_id"])
    except ValueError as error:
        raise LanternError(f"cannot write {out}: {error}") from None
    scaling = config.rope_scaling
    problems = family.gguf_problems(config)
    if scaling is not None and scaling.rope_type != "linear" and architecture != "llama":
        problems.append("Llama 3.1 RoPE scaling")
    if problems:
        raise LanternError(f"cannot write {out} as llama.cpp's {architecture!r}, which fixes: {'; '.join(problems)}")
    state = native_to_hf_state(native_state(model), config)
    names = get_tensor_name_map(next(a for a, n in MODEL_ARCH_NAMES.items() if n == architecture), config.n_layers)

    def write(temporary: Path) -> None:
        writer = GGUFWriter(temporary, architecture)
        try:
            writer.add_name(name or "lantern")
            writer.add_file_type(
                {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16}[
                    dtype
                ]
            )
            writer.add_vocab_size(hf["vocab_size"])
            writer.add_context_length(hf["max_position_embeddings"])
            writer.add_embedding_length(hf["hidden_size"])
            writer.add_block_count(hf["num_hidden_layers"])
            writer.add_feed_forward_length(hf["intermediate_size"])
            writer.add_head_count(hf["num_attention_heads"])
            writer.add_head_count_kv(hf["num_key_value_heads"])
            writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
            writer.add_rope_freq_base(hf["rope_theta"])
            writer.add_rope_dimension_count(config.head_dim)
            if config.head_dim * config.n_heads != config.dim:  # llama.cpp's names for heads not dim / n_heads wide
                writer.add_key_length(config.head_dim)
                writer.add_value_length(config.head_dim)
            if config.sliding_window is not None:
                writer.add_sliding_window(config.sliding_window)
            if scaling is not None:
                writer.add_string(LANTERN_ROPE_KEY, json.dumps(dataclasses.asdict(scaling)))
                if scaling.rope_type == "linear":
                    writer.add_rope_scaling_type(RopeScalingType.LINEAR)
                    writer.add_rope_scaling_factor(scaling.factor)
                else:
                    writer.add_tensor("rope_freqs.weight", _rope_divisors(config).numpy())
            add_tokenizer_fields(writer, fields)
            adders = {bool: writer.add_bool, int: writer.add_int64, float: writer.add_float32, str: writer.add_string}
            for key, value in (metadata or {}).items():
                if type(value) not in adders:
                    raise LanternError(
                        f"cannot write {out}: metadata {key!r} is a {type(value).__name__}, not str/int/float/bool"
                    )
                adders[type(value)](key, value)
            for hf_name, tensor in state.items():
                module, _, kind = hf_name.rpartition(".")  # kind: weight or bias
                gguf_name = names.get_name(module)
                if gguf_name is None:
                    raise LanternError(f"cannot write {out}: no GGUF name for {hf_name}")
                if family.gguf_interleaved_qk and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
                    heads = config.n_heads if "q_proj" in hf_name else config.n_kv_heads
                    tensor = _llama_cpp_permute(tensor, heads)
                if module.endswith("norm") and family.gguf_norm_shift:
                    tensor = tensor.float() + family.gguf_norm_shift
                array, raw_dtype = _gguf_array(tensor, dtype)
                writer.add_tensor(f"{gguf_name}.{kind}", array, raw_dtype=raw_dtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()

    # large: a killed write of this file leaves gigabytes, which the next one removes
    return write_file_atomically(out, write, what="GGUF file", large=True, previous="file")
