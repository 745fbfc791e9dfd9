"""
Preference rows: records -> (prompt, chosen, rejected) chats, for the reward model and the other preference stages.

Schemas (auto-detected from the columns: "pairs" when there is a prompt column, or set with `schema`):

    pairs            {"prompt", "chosen", "rejected"}: prompt is a string (one user turn) or a message list; chosen
                     and rejected are strings (the assistant reply) or message lists (the assistant turn(s) after
                     the prompt; a list that repeats the prompt first, as UltraFeedback-binarized writes it, has
                     that part removed).
    implicit_prompt  {"chosen", "rejected"}, two whole conversations and no prompt: TRL's implicit-prompt message
                     lists, or Anthropic HH-RLHF transcripts "\\n\\nHuman: ...\\n\\nAssistant: ..." (Human -> user,
                     Assistant -> assistant). Their longest shared prefix of turns is the prompt; what follows on
                     each side, ending with an assistant turn and with no user or system turn, is the reply.
                     "hh", its former name, still selects it.

Message lists may use OpenAI's {"role", "content"} or ShareGPT's {"from", "value"} keys
(check_messages).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from data.preference.config import PreferenceDataConfig
from data.records.chat import (  # SFT's loaders and row checks: the same files, errors and bad-row reasons
    BadRow,
    check_messages,
    field_turns,
    load_rows,
    required_field,
    type_name,
)

log = logging.getLogger("lantern.rm")

Messages = list[dict[str, str]]


@dataclass
class PreferenceChat:
    prompt: Messages  # the shared conversation before the replies
    chosen: Messages  # the preferred reply: assistant turn(s), the last one scored
    rejected: Messages
    where: str  # "<file>, line N" (Conversation.where)


def detect_schema(columns: Sequence[str], config: PreferenceDataConfig, where: str) -> str:
    if config.schema != "auto":
        return config.schema
    if config.chosen_field in columns and config.rejected_field in columns:
        return "pairs" if config.prompt_field in columns else "implicit_prompt"
    raise ValueError(
        f"{where}: cannot tell the preference schema from the columns {list(columns)}: expected "
        f"{config.prompt_field!r} + {config.chosen_field!r} + {config.rejected_field!r} (pairs) or "
        f"{config.chosen_field!r} + {config.rejected_field!r} as whole conversations, message lists or HH "
        "transcripts (implicit_prompt); set schema and the *_field names"
    )


def _reply(value: Any, name: str, prompt: Messages) -> Messages:
    turns = field_turns(value, name, "assistant")
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


def conversation_turns(value: Any, name: str) -> Messages:
    """One side of an implicit-prompt pair as turns: an HH transcript (a string) or a message list."""
    if isinstance(value, str):
        return parse_hh(value, name)
    if isinstance(value, list):
        return check_messages(value, name)
    problem = f"{name!r} must be an HH transcript or a list of messages, got {type_name(value)}"
    raise BadRow("non_string_content", problem)


def split_implicit_prompt(
    chosen: Messages, rejected: Messages, config: PreferenceDataConfig
) -> tuple[Messages, Messages, Messages]:
    """(prompt, chosen reply, rejected reply) of two whole conversations: their longest shared prefix of turns,
    then what follows on each side, which must be assistant turns (tool turns between them allowed)."""
    for name, turns in ((config.chosen_field, chosen), (config.rejected_field, rejected)):
        if not turns or turns[-1]["role"] != "assistant":
            last = f"ends with a {turns[-1]['role']} turn" if turns else "has no turns"
            raise BadRow("not_ending_with_assistant", f"{name!r} must end with an assistant turn, it {last}")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == len(chosen) == len(rejected):
        return chosen[:-1], chosen[-1:], rejected[-1:]  # identical conversations: dropped as identical later
    if not shared:
        names = f"{config.chosen_field!r} and {config.rejected_field!r}"
        raise BadRow("malformed", f"{names} differ from their first turn on: there is no shared prompt")
    chosen_reply, rejected_reply = chosen[shared:], rejected[shared:]  # one may be [], an empty reply dropped later
    if any(turn["role"] in ("user", "system") for turn in chosen_reply + rejected_reply):
        raise BadRow(
            "malformed",
            f"the conversations diverge at turn {shared + 1} but may differ only in the assistant turns at their end "
            f"({len(chosen_reply)} and {len(rejected_reply)} turns follow the shared prompt, a user or system one "
            "among them)",
        )
    return chosen[:shared], chosen_reply, rejected_reply


def record_to_chat(record: Mapping[str, Any], schema: str, config: PreferenceDataConfig, where: str) -> PreferenceChat:
    """The pair a row holds under `schema`; BadRow says why there is none."""
    if schema == "pairs":
        prompt = field_turns(required_field(record, config.prompt_field), config.prompt_field, "user")
        chosen = _reply(required_field(record, config.chosen_field), config.chosen_field, prompt)
        rejected = _reply(required_field(record, config.rejected_field), config.rejected_field, prompt)
    elif schema in ("implicit_prompt", "hh"):
        chosen_turns = conversation_turns(required_field(record, config.chosen_field), config.chosen_field)
        rejected_turns = conversation_turns(required_field(record, config.rejected_field), config.rejected_field)
        prompt, chosen, rejected = split_implicit_prompt(chosen_turns, rejected_turns, config)
    else:
        raise ValueError(f"unknown preference schema {schema!r}")
    if config.system_prompt is not None and not any(m["role"] == "system" for m in prompt):
        prompt = [{"role": "system", "content": config.system_prompt}, *prompt]
    return PreferenceChat(prompt, chosen, rejected, where)


def load_chats(
    config: PreferenceDataConfig, sources: Sequence[str], split: str = "train", logger: logging.Logger = log
) -> tuple[list[PreferenceChat], dict[str, Any]]:
    """Every good row of `sources` as a PreferenceChat, plus {rows_read, skipped: {reason: count}}; skipped rows
    are warned about through `logger` (the stage's: the reward model's by default, DPO's for DPO)."""

    def convert(record: Mapping[str, Any], schema: str, where: str) -> PreferenceChat:
        return record_to_chat(record, schema, config, where)

    return load_rows(config, sources, split, detect_schema, convert, logger)  # loop
