"""The pretraining data config: one corpus, or a weighted mixture of named sources."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from models.config_checks import bounded
from models.errors import ConfigError

DEFAULT_SOURCE = ["data/corpus/tinyshakespeare.txt"]
# a source's name is its folder under data.out_dir and its metrics' key (val/NAME/loss): no path or key separators
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass
class SourceConfig:
    """One source of a mixture: its files, its name and its weight; the reading settings it leaves unset are data's."""

    name: str = ""  # the folder under data.out_dir and the metrics' key: val/NAME/loss
    source: list[str] = field(default_factory=list)  # files, globs or one hub dataset name
    weight: float = bounded(1.0, gt=0)  # relative: the weights are normalised to shares
    format: Literal["auto", "text", "json", "parquet", "hub"] | None = None  # None: data.format
    text_field: str | None = None  # None: data.text_field
    sample_by: Literal["line", "paragraph", "document"] | None = None  # None: data.sample_by

    def check_fields(self, prefix: str) -> None:
        if not SOURCE_NAME.fullmatch(self.name):
            raise ConfigError(
                f"{prefix}name must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter or digit), "
                f"got {self.name!r}: it names the source's folder and its metrics"
            )
        if not self.source:
            raise ConfigError(f"{prefix}source is empty; give at least one file, glob or hub dataset name")


@dataclass
class PrepareConfig:
    source: list[str] = field(default_factory=lambda: list(DEFAULT_SOURCE))
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
    # a weighted mixture instead of `source`: each source prepared into out_dir/NAME, windows drawn by weight
    sources: list[SourceConfig] = field(default_factory=list)

    def check_fields(self, prefix: str) -> None:
        if not self.sources:
            return
        # `source` has a default, so only a value other than it (or []) can be told apart from "not given"
        if self.source and self.source != DEFAULT_SOURCE:
            raise ConfigError(
                f"{prefix}source and {prefix}sources are both set: a mixture lists its files under each source; "
                f"remove {prefix}source (or set it to [])"
            )
        seen: dict[str, int] = {}
        for index, item in enumerate(self.sources):
            other = seen.setdefault(item.name.lower(), index)  # case-insensitive: the names are folders
            if other != index:
                raise ConfigError(
                    f"{prefix}sources[{index}].name {item.name!r} repeats {prefix}sources[{other}].name "
                    f"{self.sources[other].name!r}: each source needs its own name"
                )

    @property
    def mixture(self) -> bool:
        """Whether this section describes a weighted mixture (``sources``) rather than one corpus (``source``)."""
        return bool(self.sources)
