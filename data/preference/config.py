"""The preference (reward model, DPO) data config: every setting of the pair pipeline, each declaring what it
accepts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from models.config_checks import bounded


@dataclass
class PreferenceDataConfig:
    train: list[str]  # files / globs (json, jsonl, parquet), or one hub dataset name with format: hub
    val: list[str] = field(default_factory=list)  # empty: hold out val_fraction of the train pairs
    val_fraction: float = bounded(0.05, ge=0, lt=1)
    format: Literal["auto", "json", "jsonl", "parquet", "hub"] = "auto"  # auto: by extension
    # auto: from the columns; implicit_prompt: TRL message lists or HH transcripts (hh: its former name)
    schema: Literal["auto", "pairs", "implicit_prompt", "hh"] = "auto"
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_prompt: str | None = None  # prepended as a system turn to prompts that have none
    tokenizer: str = "auto"
    seq_len: int = bounded(256, ge=2)  # the longest side, prompt + reply: at least a token of each
    too_long: Literal["truncate", "drop"] = "truncate"  # truncate: the prompt, from the left
    pad_to_seq_len: bool = False  # pad every batch to seq_len (static shapes) instead of its longest side
    on_bad_row: Literal["error", "skip"] = "error"  # skip: counted per reason
    seed: int = bounded(1234, ge=0)
    num_proc: int = bounded(1, ge=1)  # processes for encoding
