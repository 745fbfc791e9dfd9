"""
Chat records: files -> rows -> validated conversations, for SFT (and the preference and prompt loaders).

Owns: resolving and loading SFT-style inputs one file at a time (resolve_sources, read_records), mapping a row
to chat messages by schema ("messages", "prompt_response", "alpaca"; detect_schema, record_to_messages), the
row checks and their reasons (BadRow, BAD_ROW_REASONS, check_messages, required_field, string_field), the
error-or-skip loop over rows (load_rows), and the seeded val hold-out (hold_out).
Does not own: file formats, UTF-8 and JSON diagnosis (data/sources.py), tokenizing and the chat template
(data/sft_examples.py, data/tokenizer.py), rows and batches (data/sft_rows.py, data/sft_batches.py).
Choices: nothing is repaired silently: a bad row raises a ValueError naming file, row, reason and schema, or
with on_bad_row=skip is skipped and counted per reason. An optional system prompt is prepended only to rows
without a system turn; a conversation must end with a non-empty assistant turn.
"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from data.prepare import choose_val
from data.prepare_config import PrepareConfig
from data.sft_config import SFTDataConfig
from data.sources import json_rows, load_source, resolve_inputs
from data.tokenizer import CHAT_ROLES
from models.errors import DataError

log = logging.getLogger("lantern.sft")
T = TypeVar("T")

BAD_ROW_REASONS = (
    "missing_field",  # a mapped field (or a message's role / content) is absent or null
    "empty_assistant",  # an assistant turn whose content is only whitespace
    "not_ending_with_assistant",  # nothing to answer: the conversation is empty or ends with another role
    "unknown_role",  # a role the chat template does not know
    "non_string_content",  # content (or prompt / response / instruction / input / output) that is not a string
    "malformed",  # wrong structure: messages that are not a list of objects
)


class BadRow(ValueError):
    """A row that cannot become a conversation; `reason` is one of BAD_ROW_REASONS."""

    def __init__(self, reason: str, problem: str):
        super().__init__(problem)
        self.reason, self.problem = reason, problem


@dataclass
class Conversation:
    messages: list[dict[str, str]]  # validated {role, content} turns, ending with the assistant
    record: dict[str, Any]  # the row as loaded
    where: str  # "<file>, row N" (1-based)


def resolve_sources(config: SFTDataConfig, sources: Sequence[str]) -> tuple[str, list[str]]:
    """(format, files) for `sources`, or ("hub", [name]): data/sources.py's resolution, SFT formats only."""
    fmt = "json" if config.format == "jsonl" else config.format
    fmt, files = resolve_inputs(PrepareConfig(source=list(sources), format=fmt))
    if fmt not in ("json", "parquet", "hub"):
        raise ValueError(f"SFT data must be JSON / JSON lines, Parquet or a hub dataset; {files[0]} is {fmt}")
    return fmt, files


def read_records(fmt: str, source: str, num_proc: int = 1) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, column names) of one file (or hub dataset), loaded with `datasets` into a throwaway cache."""
    settings = PrepareConfig(source=[source], format=fmt, num_proc=num_proc)
    with tempfile.TemporaryDirectory(prefix="lantern-sft-") as cache_dir:
        try:
            ds = load_source(fmt, [source], settings, cache_dir=cache_dir)
        except DataError:  # already names the file and line
            raise
        except ValueError as error:
            if fmt == "json":  # name the broken line ourselves: prepare's diagnosis looks for a text field
                for where, record in json_rows(source):
                    if isinstance(record, Exception):
                        raise ValueError(f"cannot read {where}: invalid JSON ({record.msg})") from error
            raise
        records, columns = ds.to_list(), list(ds.column_names)
        del ds  # release the memory-mapped cache before it is deleted
    return records, columns


def detect_schema(columns: Sequence[str], config: SFTDataConfig, where: str) -> str:
    if config.schema != "auto":
        return config.schema
    if config.messages_field in columns:
        return "messages"
    if config.prompt_field in columns and config.response_field in columns:
        return "prompt_response"
    if config.instruction_field in columns and config.output_field in columns:
        return "alpaca"
    raise ValueError(
        f"{where}: cannot tell the schema from the columns {list(columns)}: expected {config.messages_field!r} "
        f"(messages), {config.prompt_field!r} + {config.response_field!r} (prompt_response) or "
        f"{config.instruction_field!r} + {config.output_field!r} (alpaca); set schema and the *_field names"
    )


def type_name(value: Any) -> str:
    return type(value).__name__


def required_field(record: Mapping[str, Any], name: str) -> Any:
    value = record.get(name)
    if value is None:  # absent, or null (datasets fills absent columns with null)
        raise BadRow("missing_field", f"no {name!r} field")
    return value


def string_field(record: Mapping[str, Any], name: str) -> str:
    value = required_field(record, name)
    if not isinstance(value, str):
        raise BadRow("non_string_content", f"{name!r} must be a string, got {type_name(value)}")
    return value


def check_messages(messages: Any, name: str) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise BadRow("malformed", f"{name!r} must be a list of messages, got {type_name(messages)}")
    checked = []
    for index, message in enumerate(messages):
        where = f"{name}[{index}]"
        if not isinstance(message, Mapping):
            raise BadRow("malformed", f"{where} must be an object with 'role' and 'content', got {type_name(message)}")
        role, content = message.get("role"), message.get("content")
        if role is None:
            raise BadRow("missing_field", f"{where} has no 'role'")
        if role not in CHAT_ROLES:
            raise BadRow("unknown_role", f"{where} has unknown role {role!r}; allowed: {', '.join(CHAT_ROLES)}")
        if content is None:
            raise BadRow("missing_field", f"{where} ({role}) has no 'content'")
        if not isinstance(content, str):
            raise BadRow("non_string_content", f"{where} ({role}) content must be a string, got {type_name(content)}")
        checked.append({"role": role, "content": content})
    return checked


def record_to_messages(record: Mapping[str, Any], schema: str, config: SFTDataConfig) -> list[dict[str, str]]:
    """The conversation a row holds under `schema`; BadRow says why there is none."""
    if schema == "messages":
        messages = check_messages(required_field(record, config.messages_field), config.messages_field)
    elif schema == "prompt_response":
        prompt = required_field(record, config.prompt_field)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            messages = check_messages(prompt, config.prompt_field)
        else:
            raise BadRow(
                "non_string_content",
                f"{config.prompt_field!r} must be a string or a list of messages, got {type_name(prompt)}",
            )
        messages.append({"role": "assistant", "content": string_field(record, config.response_field)})
    elif schema == "alpaca":
        instruction = string_field(record, config.instruction_field)
        extra = record.get(config.input_field)
        if extra is not None and not isinstance(extra, str):
            raise BadRow("non_string_content", f"{config.input_field!r} must be a string, got {type_name(extra)}")
        user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        output = string_field(record, config.output_field)
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    else:
        raise ValueError(f"unknown schema {schema!r}")

    if config.system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    if not messages or messages[-1]["role"] != "assistant":
        last = f"a {messages[-1]['role']} turn" if messages else "no turns at all"
        raise BadRow("not_ending_with_assistant", f"the conversation must end with an assistant turn, it has {last}")
    for index, message in enumerate(messages):
        if message["role"] == "assistant" and not message["content"].strip():
            raise BadRow("empty_assistant", f"assistant turn (message {index}) is empty")
    return messages


def load_rows(
    config: Any,
    sources: Sequence[str],
    split: str,
    detect: Callable[[Sequence[str], Any, str], str],
    convert: Callable[[Mapping[str, Any], str, str], T],
    logger: logging.Logger = log,
) -> tuple[list[T], dict[str, Any]]:
    """`convert(record, schema, where)` of every good row of `sources`, plus {rows_read, skipped: {reason: count}}.

    The loop SFT and preference data share: config.format selects the files, config.num_proc the processes
    that load them, config.on_bad_row what a BadRow does (raise a ValueError naming file, row, reason and
    schema, or skip and count, warning through `logger`); `detect(columns, config, label)` gives each file's
    schema."""
    fmt, files = resolve_sources(config, sources)
    items: list[T] = []
    skipped: Counter[str] = Counter()
    rows = 0
    for source in files:
        label = f"hub dataset {source}" if fmt == "hub" else source
        records, columns = read_records(fmt, source, config.num_proc)
        schema = detect(columns, config, label)
        for index, record in enumerate(records):
            where = f"{label}, row {index + 1}"
            try:
                items.append(convert(record, schema, where))
            except BadRow as bad:
                if config.on_bad_row == "error":
                    raise ValueError(
                        f"{where}: {bad.problem} ({bad.reason}; schema {schema}); fix the row or set on_bad_row: skip"
                    ) from None
                if not skipped[bad.reason]:
                    logger.warning("%s: skipping bad rows; first %s: %s: %s", split, bad.reason, where, bad.problem)
                skipped[bad.reason] += 1
        rows += len(records)
    if skipped:
        logger.warning(
            "%s: skipped %d of %d rows: %s", split, sum(skipped.values()), rows, dict(sorted(skipped.items()))
        )
    return items, {"rows_read": rows, "skipped": dict(sorted(skipped.items()))}


def load_conversations(
    config: SFTDataConfig, sources: Sequence[str], split: str = "train"
) -> tuple[list[Conversation], dict[str, Any]]:
    """Every good row of `sources` as a Conversation, plus {rows_read, skipped: {reason: count}}."""

    def convert(record: Mapping[str, Any], schema: str, where: str) -> Conversation:
        return Conversation(record_to_messages(record, schema, config), record, where)

    return load_rows(config, sources, split, detect_schema, convert)


def hold_out(conversations: list, config: SFTDataConfig) -> tuple[list, list]:
    """(train, val): a seeded choice of round(val_fraction * n) (at least 1) examples for validation."""
    if config.val_fraction == 0:
        return list(conversations), []
    try:
        is_val = choose_val(len(conversations), config)  # data/prepare.py's seeded choice
    except ValueError:
        raise ValueError(
            f"cannot hold out val_fraction={config.val_fraction} of {len(conversations)} train examples and keep "
            "any for training: add data, lower val_fraction (0 disables validation) or give val files"
        ) from None
    train = [c for c, v in zip(conversations, is_val) if not v]
    val = [c for c, v in zip(conversations, is_val) if v]
    return train, val
