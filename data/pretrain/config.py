"""
The pretraining data config, and the normalisation every data config shares.

Owns: PrepareConfig, its allowed values (FORMATS, SAMPLE_BY) and their validation; normalize_dataclass, which
the SFT and preference configs (data/sft/config.py, data/preference/config.py) use as well.
Does not own: what the settings do: reading the inputs is data/pretrain/sources.py's, the manifest and staleness
data/pretrain/manifest.py's, tokenizing and writing shards data/pretrain/prepare.py's.
Choices: plain dataclasses checked once, up front, the way every config is (models/config_checks.py: a ConfigError
names the bad setting before any file is touched); nothing heavy is imported, so a config can be built without
numpy, datasets or a tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from models.config_checks import check_choices, check_ranges
from models.errors import ConfigError

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


def check_data_config(config: Any, where: str, inputs: str, choices: Mapping[str, Sequence[str]]) -> None:
    """The checks every data config shares: a non-empty input list (field ``inputs``), each field of
    ``choices`` holding one of its allowed values, and every numeric field in its range (``RANGES``). One
    ConfigError per problem, prefixed with ``where`` and naming the field."""
    if not getattr(config, inputs):
        raise ConfigError(f"{where}: `{inputs}` is empty; give at least one file, glob or hub dataset name")
    check_choices(config, choices, where)
    check_ranges(config, where)


def normalize_prepare_config(config: PrepareConfig | dict) -> PrepareConfig:
    """A validated copy with plain Python types (callers may pass a dict or an OmegaConf-built object)."""
    return normalize_dataclass(PrepareConfig, config, ("source",), _validate_config)


def _validate_config(config: PrepareConfig) -> None:
    check_data_config(config, "prepare", "source", {"format": FORMATS, "sample_by": SAMPLE_BY})
