"""
The preference (reward-model) data config: PreferenceDataConfig, its allowed values and its validation.

Owns: every setting of the preference data pipeline (sources, schema and field names, system prompt, tokenizer,
seq_len, truncation, padding, bad-row policy, seed, processes) and the checks that reject bad values up front.
Does not own: what the settings do (data/preference/records.py reads rows into chats, data/preference/pairs.py
encodes and batches them; see their docstrings).
Choices: one flat dataclass, normalised with data/pretrain/config.py's normalize_dataclass like the SFT config
(data/sft/config.py), so a dict, an OmegaConf object or a PreferenceDataConfig all work; errors start with
"preference data config:" and name the setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from data.pretrain.config import check_data_config, normalize_dataclass
from models.errors import ConfigError

SCHEMAS = ("auto", "pairs", "implicit_prompt", "hh")  # hh: implicit_prompt's former name
FORMATS = ("auto", "json", "jsonl", "parquet", "hub")
TOO_LONG = ("truncate", "drop")
ON_BAD_ROW = ("error", "skip")


@dataclass
class PreferenceDataConfig:
    train: list[str]  # files / globs (json, jsonl, parquet), or one hub dataset name with format: hub
    val: list[str] = field(default_factory=list)  # empty: hold out val_fraction of the train pairs
    val_fraction: float = 0.05
    format: str = "auto"  # auto (by extension) | json | jsonl | parquet | hub
    schema: str = "auto"  # auto (from the columns) | pairs | implicit_prompt (TRL message lists or HH transcripts)
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_prompt: str | None = None  # prepended as a system turn to prompts that have none
    tokenizer: str = "auto"
    seq_len: int = 256  # the longest side, prompt + reply, in tokens
    too_long: str = "truncate"  # truncate (the prompt, from the left) | drop
    pad_to_seq_len: bool = False  # pad every batch to seq_len (static shapes) instead of its longest side
    on_bad_row: str = "error"  # error | skip (counted per reason)
    seed: int = 1234
    num_proc: int = 1  # processes for encoding


def normalize_config(config: PreferenceDataConfig | Mapping[str, Any]) -> PreferenceDataConfig:
    """A validated copy with plain Python types (accepts a dict or an OmegaConf-built object)."""
    return normalize_dataclass(PreferenceDataConfig, config, ("train", "val"), validate_config)


def validate_config(config: PreferenceDataConfig) -> None:
    check_data_config(
        config,
        "preference data config",
        "train",
        {"format": FORMATS, "schema": SCHEMAS, "too_long": TOO_LONG, "on_bad_row": ON_BAD_ROW},
    )
    if config.seq_len < 2:  # a prompt token and a response token: stricter than the seq_len every config shares
        raise ConfigError(f"preference data config: seq_len must be >= 2 but got {config.seq_len}")
