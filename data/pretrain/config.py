"""
The pretraining data config, and the normalisation every data config shares.

Owns: PrepareConfig, its allowed values (FORMATS, SAMPLE_BY) and their validation; normalize_dataclass, which
the SFT and preference configs (data/sft/config.py, data/preference/config.py) use as well.
Does not own: what the settings do: reading the inputs is data/pretrain/sources.py's, the manifest and staleness
data/pretrain/manifest.py's, tokenizing and writing shards data/pretrain/prepare.py's.
Choices: plain dataclasses checked once, up front (a ValueError names the bad setting before any file is
touched); only the standard library is imported, so a config can be built without numpy, datasets or a tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

FORMATS = ("auto", "text", "json", "parquet", "hub")
SAMPLE_BY = ("line", "paragraph", "document")


@dataclass
class PrepareConfig:
    source: list[str] = field(default_factory=lambda: ["data/corpus/tinyshakespeare.txt"])
    format: str = "auto"  # text | json (also jsonl) | parquet | hub | auto (by file extension)
    text_field: str = "text"  # json / parquet / hub column holding the document text
    sample_by: str = "paragraph"  # text files: one document per line | paragraph | document (file)
    tokenizer: str = "default"
    out_dir: str = "runs/data/shakespeare"
    val_fraction: float = 0.05  # fraction of documents held out for validation
    seed: int = 1234
    num_proc: int = 2
    add_bos: bool = True
    add_eos: bool = True
    shard_tokens: int = 2**27  # tokens per shard file (256 MiB of uint16)


C = TypeVar("C")


def normalize_dataclass(
    cls: type[C], config: C | Mapping[str, Any], list_fields: Sequence[str], validate: Callable[[C], None]
) -> C:
    """A validated copy of `config` as a plain `cls` (callers may pass a `cls`, a dict or an OmegaConf-built
    object), shared by the data configs (prepare, SFT, preference). Each of `list_fields` becomes a list of str:
    a bare string would be iterated character by character, and OmegaConf hands over a ListConfig."""
    if isinstance(config, cls):
        config = dataclasses.asdict(config)
    config = cls(**dict(config))
    for name in list_fields:
        value = getattr(config, name)
        setattr(config, name, [value] if isinstance(value, str) else [str(v) for v in value])
    validate(config)
    return config


def check_data_config(
    config: Any, where: str, inputs: str, choices: Mapping[str, Sequence[str]], val_fraction: bool = True
) -> None:
    """The checks every data config shares: a non-empty input list (field ``inputs``), each field of
    ``choices`` holding one of its allowed values, and ``val_fraction`` in [0, 1). One ValueError per
    problem, prefixed with ``where`` and naming the field."""
    if not getattr(config, inputs):
        raise ValueError(f"{where}: `{inputs}` is empty; give at least one file, glob or hub dataset name")
    for key, allowed in choices.items():
        if getattr(config, key) not in allowed:
            raise ValueError(f"{where}: {key} must be one of {', '.join(allowed)}, got {getattr(config, key)!r}")
    if val_fraction and not 0.0 <= config.val_fraction < 1.0:
        raise ValueError(f"{where}: val_fraction must be in [0, 1), got {config.val_fraction}")


def normalize_prepare_config(config: PrepareConfig | dict) -> PrepareConfig:
    """A validated copy with plain Python types (callers may pass a dict or an OmegaConf-built object)."""
    return normalize_dataclass(PrepareConfig, config, ("source",), _validate_config)


def _validate_config(config: PrepareConfig) -> None:
    check_data_config(config, "prepare", "source", {"format": FORMATS, "sample_by": SAMPLE_BY})
    if config.shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {config.shard_tokens}")
    if config.num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {config.num_proc}")
