"""The pretraining data config, and the one check a data config gets where it enters ``data/``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from models.config_checks import bounded
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


def require_inputs(inputs: Sequence[str], where: str, key: str) -> None:
    """Refuse an empty list of inputs as ``data/`` receives it: the one data rule load cannot check, since a stage
    may fill the list after load (rejection sampling's samples, the reward model's generated pairs)."""
    if not inputs:
        raise ConfigError(f"{where}: `{key}` is empty; give at least one file, glob or hub dataset name")
