"""The pretraining data config, and the check every data config makes where it enters ``data/``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from models.config_checks import bounded, check_config
from models.errors import ConfigError


@dataclass
class PrepareConfig:
    source: list[str] = field(default_factory=lambda: ["data/corpus/tinyshakespeare.txt"])
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"  # json also reads jsonl; auto: by extension
    text_field: str = "text"  # json / parquet / hub column holding the document text
    sample_by: Literal["line", "paragraph", "document"] = "paragraph"  # text files: what one document is
    tokenizer: str = "default"
    out_dir: str = "runs/data/shakespeare"
    val_fraction: float = bounded(0.05, ge=0, lt=1)  # fraction of documents held out for validation
    seed: int = bounded(1234, ge=0)
    num_proc: int = bounded(2, ge=1)
    add_bos: bool = True
    add_eos: bool = True
    shard_tokens: int = bounded(2**27, ge=1)  # tokens per shard file (256 MiB of uint16)


C = TypeVar("C")


def checked_data_config(config: C, where: str, inputs: str, list_fields: Sequence[str]) -> C:
    """A data config as ``data/`` receives it: a non-empty ``inputs`` list and every field as declared (one
    ``ConfigError`` after ``where``); returned with its ``list_fields`` copied, so the caller's config never changes."""
    if not getattr(config, inputs):
        raise ConfigError(f"{where}: `{inputs}` is empty; give at least one file, glob or hub dataset name")
    check_config(config, where)
    return dataclasses.replace(config, **{name: list(getattr(config, name)) for name in list_fields})  # type: ignore[type-var]


def normalize_prepare_config(config: PrepareConfig) -> PrepareConfig:
    """``config`` checked for ``lantern prepare``."""
    return checked_data_config(config, "prepare", "source", ("source",))
