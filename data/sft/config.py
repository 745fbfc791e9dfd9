"""The SFT data config: every setting of the SFT data pipeline, each declaring what it accepts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from models.config_checks import bounded
from models.errors import ConfigError


@dataclass
class SFTDataConfig:
    train: list[str]  # files / globs (json, jsonl, parquet), or one hub dataset name with format: hub
    val: list[str] = field(default_factory=list)  # empty: hold out val_fraction of the train examples
    val_fraction: float = bounded(0.05, ge=0, lt=1)
    format: Literal["auto", "json", "jsonl", "parquet", "hub"] = "auto"  # auto: by extension
    # auto: from the columns
    schema: Literal["auto", "messages", "sharegpt", "prompt_response", "prompt_completion", "alpaca"] = "auto"
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
    seq_len: int = bounded(256, ge=1)
    train_on_prompt: bool = False  # supervise every token, not only the assistant turns
    packing: bool = True
    too_long: Literal["truncate", "drop"] = "truncate"  # examples longer than seq_len + 1 tokens
    on_bad_row: Literal["error", "skip"] = "error"  # skip: counted per reason
    short_answer_max_tokens: int = bounded(2, ge=1)  # an answer (last assistant turn + <|eot_id|>) this short is short
    short_answer_factor: int = bounded(1, ge=1)  # copies of each short-answer train example (1 = no upsampling)
    short_answer_target_share: float | None = bounded(None, ge=0, lt=1)  # or: upsample short ones to this share
    seed: int = bounded(1234, ge=0)
    num_proc: int = bounded(1, ge=1)  # processes for encoding

    def check_fields(self, prefix: str) -> None:
        if self.short_answer_target_share is not None and self.short_answer_factor != 1:
            raise ConfigError(f"set {prefix}short_answer_factor or {prefix}short_answer_target_share, not both")
