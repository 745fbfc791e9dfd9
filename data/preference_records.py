"""
Preference rows: records -> (prompt, chosen, rejected) chats, for the reward model.

Schemas (auto-detected from the columns, or set with `schema`):

    pairs   {"prompt", "chosen", "rejected"}: prompt is a string (one user turn) or a message list; chosen and
            rejected are strings (the assistant reply) or message lists (the assistant turn(s) after the prompt;
            a list that repeats the prompt first, as UltraFeedback-binarized writes it, has that part removed).
    hh      Anthropic HH-RLHF {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "..."}: two full
            transcripts. Their longest shared prefix of turns is the prompt (Human -> user, Assistant ->
            assistant) and each side's remaining turn, its final Assistant turn, is the reply.

Owns: PreferenceChat, telling the schema from the columns (detect_schema), reading a row under a schema
(record_to_chat; HH transcripts: parse_hh, hh_to_pair) and loading every good row of the sources (load_chats).
Does not own: the settings (data/preference_config.py), files, formats and the error-or-skip loop over rows
(data/chat_records.py, shared with SFT), dropping uninformative pairs, encoding and batches
(data/preference.py).
Choices: loading goes through Hugging Face `datasets` one file at a time (data/chat_records.py's loaders), so
every problem names its file and row; bad rows raise or are skipped and counted per reason (on_bad_row) with
SFT's reasons. An empty reply is not a bad row here: it is kept, then dropped and counted with the pairs that
carry no preference. An optional system prompt is prepended only to prompts without a system turn.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from data.chat_records import (  # SFT's loaders and row checks: the same files, errors and bad-row reasons
    BadRow,
    check_messages,
    load_rows,
    required_field,
    string_field,
    type_name,
)
from data.preference_config import PreferenceDataConfig

log = logging.getLogger("lantern.rm")

Messages = list[dict[str, str]]


@dataclass
class PreferenceChat:
    prompt: Messages  # the shared conversation before the replies
    chosen: Messages  # the preferred reply: assistant turn(s), the last one scored
    rejected: Messages
    where: str  # "<file>, row N" (1-based)


def detect_schema(columns: Sequence[str], config: PreferenceDataConfig, where: str) -> str:
    if config.schema != "auto":
        return config.schema
    if config.chosen_field in columns and config.rejected_field in columns:
        return "pairs" if config.prompt_field in columns else "hh"
    raise ValueError(
        f"{where}: cannot tell the preference schema from the columns {list(columns)}: expected "
        f"{config.prompt_field!r} + {config.chosen_field!r} + {config.rejected_field!r} (pairs) or "
        f"{config.chosen_field!r} + {config.rejected_field!r} transcripts (hh); set schema and the *_field names"
    )


def _prompt(value: Any, name: str) -> Messages:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return check_messages(value, name)
    raise BadRow("non_string_content", f"{name!r} must be a string or a list of messages, got {type_name(value)}")


def _reply(value: Any, name: str, prompt: Messages) -> Messages:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list):
        raise BadRow("non_string_content", f"{name!r} must be a string or a list of messages, got {type_name(value)}")
    turns = check_messages(value, name)
    if len(turns) > len(prompt) and turns[: len(prompt)] == prompt:
        turns = turns[len(prompt) :]  # the whole conversation was given: keep what follows the prompt
    if turns and turns[-1]["role"] != "assistant":
        last = turns[-1]["role"]
        raise BadRow("not_ending_with_assistant", f"{name!r} must end with an assistant turn, it ends with {last!r}")
    return turns  # [] is an empty reply: dropped and counted later, not a bad row


HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def parse_hh(text: str, name: str) -> Messages:
    """An HH transcript "\\n\\nHuman: ...\\n\\nAssistant: ..." as chat turns (content stripped)."""
    parts = HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise BadRow("malformed", f"{name!r} is not an HH transcript (it must start with '\\n\\nHuman:' turns)")
    return [{"role": HH_ROLES[role], "content": content.strip()} for role, content in zip(parts[1::2], parts[2::2])]


def hh_to_pair(
    chosen_text: str, rejected_text: str, config: PreferenceDataConfig
) -> tuple[Messages, Messages, Messages]:
    """(prompt, chosen reply, rejected reply): the longest shared prefix of turns, then each side's last turn."""
    chosen = parse_hh(chosen_text, config.chosen_field)
    rejected = parse_hh(rejected_text, config.rejected_field)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    prompt, chosen_rest, rejected_rest = chosen[:shared], chosen[shared:], rejected[shared:]
    if not chosen_rest and not rejected_rest:
        return prompt[:-1], prompt[-1:], prompt[-1:]  # identical transcripts: dropped as identical later
    if not prompt:
        raise BadRow("malformed", "the transcripts share no turns: there is no common prompt")
    if len(chosen_rest) != 1 or len(rejected_rest) != 1:
        raise BadRow(
            "malformed",
            f"the transcripts diverge at turn {shared + 1} but must differ only in their final Assistant turn "
            f"({len(chosen_rest)} and {len(rejected_rest)} turns follow the shared prompt)",
        )
    if chosen_rest[0]["role"] != "assistant" or rejected_rest[0]["role"] != "assistant":
        raise BadRow("not_ending_with_assistant", "the turns after the shared prompt must be Assistant turns")
    return prompt, chosen_rest, rejected_rest


def record_to_chat(record: Mapping[str, Any], schema: str, config: PreferenceDataConfig, where: str) -> PreferenceChat:
    """The pair a row holds under `schema`; BadRow says why there is none."""
    if schema == "pairs":
        prompt = _prompt(required_field(record, config.prompt_field), config.prompt_field)
        chosen = _reply(required_field(record, config.chosen_field), config.chosen_field, prompt)
        rejected = _reply(required_field(record, config.rejected_field), config.rejected_field, prompt)
    elif schema == "hh":
        chosen_text = string_field(record, config.chosen_field)
        prompt, chosen, rejected = hh_to_pair(chosen_text, string_field(record, config.rejected_field), config)
    else:
        raise ValueError(f"unknown preference schema {schema!r}")
    if config.system_prompt is not None and not any(m["role"] == "system" for m in prompt):
        prompt = [{"role": "system", "content": config.system_prompt}, *prompt]
    return PreferenceChat(prompt, chosen, rejected, where)


def load_chats(
    config: PreferenceDataConfig, sources: Sequence[str], split: str = "train"
) -> tuple[list[PreferenceChat], dict[str, Any]]:
    """Every good row of `sources` as a PreferenceChat, plus {rows_read, skipped: {reason: count}}."""

    def convert(record: Mapping[str, Any], schema: str, where: str) -> PreferenceChat:
        return record_to_chat(record, schema, config, where)

    return load_rows(config, sources, split, detect_schema, convert, log)  # data/chat_records.py's loop, logged as RM
