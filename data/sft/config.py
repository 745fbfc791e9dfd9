"""
The SFT data config: SFTDataConfig, its allowed values and its validation.

Owns: every setting of the SFT data pipeline (sources, schema and field names, seq_len, packing, truncation,
bad-row policy, short-answer upsampling, seed, processes) and the checks that reject bad values up front.
Does not own: what the settings do (data/sft/dataset.py runs the pipeline; see its docstring for the steps).
Choices: one flat dataclass for the whole pipeline, normalised with data/pretrain/config.py's
normalize_dataclass like the other data configs, so a dict, an OmegaConf object or an SFTDataConfig all work;
errors start with "SFT data config:" and name the setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from data.pretrain.config import check_data_config, normalize_dataclass
from models.errors import ConfigError

SCHEMAS = ("auto", "messages", "sharegpt", "prompt_response", "prompt_completion", "alpaca")
FORMATS = ("auto", "json", "jsonl", "parquet", "hub")
TOO_LONG = ("truncate", "drop")
ON_BAD_ROW = ("error", "skip")


@dataclass
class SFTDataConfig:
    train: list[str]  # files / globs (json, jsonl, parquet), or one hub dataset name with format: hub
    val: list[str] = field(default_factory=list)  # empty: hold out val_fraction of the train examples
    val_fraction: float = 0.05
    format: str = "auto"  # auto (by extension) | json | jsonl | parquet | hub
    schema: str = "auto"  # auto (from the columns) | messages | sharegpt | prompt_response | prompt_completion | alpaca
    messages_field: str = "messages"
    conversations_field: str = "conversations"  # sharegpt
    prompt_field: str = "prompt"
    response_field: str = "response"
    completion_field: str = "completion"  # prompt_completion (TRL)
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    system_prompt: str | None = None  # prepended as a system turn to rows that have none
    tokenizer: str = "auto"
    seq_len: int = 256
    train_on_prompt: bool = False  # supervise every token, not only the assistant turns
    packing: bool = True
    too_long: str = "truncate"  # truncate | drop: examples longer than seq_len + 1 tokens
    on_bad_row: str = "error"  # error | skip (counted per reason)
    short_answer_max_tokens: int = 2  # an answer (last assistant turn, content + <|eot_id|>) this short is "short"
    short_answer_factor: int = 1  # copies of each short-answer train example (1 = no upsampling)
    short_answer_target_share: float | None = None  # or: upsample short examples to this share of examples
    seed: int = 1234
    num_proc: int = 1  # processes for encoding


def normalize_config(config: SFTDataConfig | Mapping[str, Any]) -> SFTDataConfig:
    """A validated copy with plain Python types (accepts a dict or an OmegaConf-built object)."""
    return normalize_dataclass(SFTDataConfig, config, ("train", "val"), validate_config)


def validate_config(config: SFTDataConfig) -> None:
    check_data_config(
        config,
        "SFT data config",
        "train",
        {"format": FORMATS, "schema": SCHEMAS, "too_long": TOO_LONG, "on_bad_row": ON_BAD_ROW},
    )
    if config.short_answer_target_share is not None and config.short_answer_factor != 1:
        raise ConfigError("SFT data config: set short_answer_factor or short_answer_target_share, not both")
