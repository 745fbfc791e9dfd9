"""Chat records: files -> rows -> validated conversations, for SFT (and the preference and prompt loaders). ``config``
is an SFT-style data section (SFTDataConfig's fields). A bad row raises a DataError naming file, line, reason and
schema, or with on_bad_row=skip is skipped and counted per reason; nothing is repaired silently.

SFT schemas, auto-detected from a file's columns, the first that fits in this order (or set with `schema`):

    messages           {"messages": [{"role", "content"}, ...]}
    sharegpt           {"conversations": [{"from": "human" | "gpt" | ..., "value"}, ...]}
    prompt_response    {"prompt": str | messages, "response": str}
    prompt_completion  TRL's {"prompt": str | messages, "completion": str | messages}: the completion is the
                       assistant turn(s)
    alpaca             {"instruction", "input" (optional), "output"}

Any message list, in any schema (and in the preference and prompt data), may use either key style: OpenAI's
{"role", "content"} or ShareGPT's {"from", "value"}, whose first message decides the style for the list.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from data.pretrain.config import PrepareConfig
from data.pretrain.prepare import choose_val
from data.pretrain.sources import resolve_inputs
from data.records.files import RecordFile, read_records
from data.tokenizer.base import CHAT_ROLES
from models.errors import DataError

log = logging.getLogger("lantern.sft")
T = TypeVar("T")

BAD_ROW_REASONS = (
    "missing_field",  # a mapped field (or a message's role / content) is absent or null
    "empty_assistant",  # an assistant turn whose content is only whitespace
    "not_ending_with_assistant",  # nothing to answer: the conversation is empty or ends with another role
    "unknown_role",  # a role the chat template does not know (or a ShareGPT "from" that maps to none)
    "non_string_content",  # content (or prompt / response / instruction / input / output) that is not a string
    "malformed",  # wrong structure: messages that are not a list of objects, a preference pair with no shared prompt
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
    where: str  # "<file>, line N" (JSON lines; "record N" in a JSON array, "row N" in Parquet / a hub dataset)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The functions the row offers the model: its ``tools`` column (OpenAI's format, as TRL reads it), or None."""
        return self.record.get("tools") or None


def resolve_sources(config: Any, sources: Sequence[str]) -> tuple[str, list[str]]:
    """(format, files) for `sources`, or ("hub", [name]): the inputs' resolution, SFT formats only."""
    fmt = "json" if config.format == "jsonl" else config.format
    fmt, files = resolve_inputs(PrepareConfig(source=list(sources), format=fmt), formats=("json", "parquet"))
    if fmt not in ("json", "parquet", "hub"):
        raise ValueError(f"SFT data must be JSON / JSON lines, Parquet or a hub dataset; {files[0]} is {fmt}")
    return fmt, files


def detect_schema(columns: Sequence[str], config: Any, where: str) -> str:
    """The schema of a file with `columns`: config.schema, or the first in the docstring's order that fits."""
    if config.schema != "auto":
        return config.schema
    if config.messages_field in columns:
        return "messages"
    if config.conversations_field in columns:
        return "sharegpt"
    if config.prompt_field in columns and config.response_field in columns:
        return "prompt_response"
    if config.prompt_field in columns and config.completion_field in columns:
        return "prompt_completion"
    if config.instruction_field in columns and config.output_field in columns:
        return "alpaca"
    raise ValueError(
        f"{where}: cannot tell the schema from the columns {list(columns)}: expected {config.messages_field!r} "
        f"(messages), {config.conversations_field!r} (sharegpt), {config.prompt_field!r} + "
        f"{config.response_field!r} (prompt_response), {config.prompt_field!r} + {config.completion_field!r} "
        f"(prompt_completion) or {config.instruction_field!r} + {config.output_field!r} (alpaca); set schema and "
        "the *_field names"
    )


def type_name(value: Any) -> str:
    return type(value).__name__


def shown(value: Any, limit: int = 40) -> str:
    """A value for a message: its type and (the start of) its repr, e.g. "int 5"."""
    text = repr(value)
    return f"{type_name(value)} {text if len(text) <= limit else text[: limit - 3] + '...'}"


def required_field(record: Mapping[str, Any], name: str) -> Any:
    value = record.get(name)
    if value is None:
        if name in record:  # null (in a row from `datasets` maybe absent: load_rows asks the row as written)
            raise BadRow("missing_field", f"{name!r} is null")
        present = sorted(key for key, item in record.items() if item is not None)
        raise BadRow("missing_field", f"no {name!r} field (the row has {present})")  # shows a row of another format
    return value


def string_field(record: Mapping[str, Any], name: str) -> str:
    value = required_field(record, name)
    if not isinstance(value, str):
        raise BadRow("non_string_content", f"{name!r} must be a string, got {shown(value)}")
    return value


SHAREGPT_ROLES = {  # ShareGPT "from" -> chat role: FastChat's names, LLaMA-Factory's tool turns, and ours
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",  # the model's tool call: an assistant turn, supervised like any answer
    "observation": "ipython",  # the tool's result: Llama 3 gives tool output the ipython role
    "ipython": "ipython",
    "tool": "tool",
}


def is_sharegpt(messages: list) -> bool:
    """ShareGPT keys: the first message has "from" and no "role" (datasets gives absent keys as null)."""
    first = messages[0] if messages else None
    return isinstance(first, Mapping) and first.get("role") is None and first.get("from") is not None


def check_messages(messages: Any, name: str) -> list[dict[str, str]]:
    """The {role, content} turns of a message list in OpenAI's or ShareGPT's keys; BadRow says what is wrong."""
    if not isinstance(messages, list):
        raise BadRow("malformed", f"{name!r} must be a list of messages, got {type_name(messages)}")
    sharegpt = is_sharegpt(messages)
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    checked = []
    for index, message in enumerate(messages):
        where = f"{name}[{index}]"
        if not isinstance(message, Mapping):
            raise BadRow(
                "malformed",
                f"{where} must be an object with {role_key!r} and {content_key!r}, got {type_name(message)}",
            )
        role, content = message.get(role_key), message.get(content_key)
        if role is None:
            raise BadRow(
                "missing_field",
                f"{where} {role_key!r} is null" if role_key in message else f"{where} has no {role_key!r}",
            )
        if sharegpt:
            if not isinstance(role, str) or role not in SHAREGPT_ROLES:
                allowed = ", ".join(SHAREGPT_ROLES)
                raise BadRow("unknown_role", f"{where} has unknown 'from' value {role!r}; allowed: {allowed}")
            role = SHAREGPT_ROLES[role]
        elif role not in CHAT_ROLES:
            raise BadRow("unknown_role", f"{where} has unknown role {role!r}; allowed: {', '.join(CHAT_ROLES)}")
        if content is None:
            missing = f"{content_key!r} is null" if content_key in message else f"has no {content_key!r}"
            raise BadRow("missing_field", f"{where} ({role}) {missing}")
        if not isinstance(content, str):
            raise BadRow("non_string_content", f"{where} ({role}) content must be a string, got {shown(content)}")
        checked.append({"role": role, "content": content})
    return checked


def field_turns(value: Any, name: str, role: str) -> list[dict[str, str]]:
    """A prompt or reply field as turns: a string is one `role` turn, a list holds the messages themselves."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return check_messages(value, name)
    raise BadRow("non_string_content", f"{name!r} must be a string or a list of messages, got {shown(value)}")


def check_tools(tools: Any) -> None:
    """A row's ``tools``: absent, or a list of functions in OpenAI's format; BadRow says what is wrong."""
    if tools is None:
        return
    if not isinstance(tools, list) or not all(
        isinstance(tool, Mapping) and isinstance((tool.get("function") or {}).get("name"), str) for tool in tools
    ):
        raise BadRow("bad_tools", 'tools must be a list of {"type": "function", "function": {"name": ..., ...}}')


def record_to_messages(record: Mapping[str, Any], schema: str, config: Any) -> list[dict[str, str]]:
    """The conversation a row holds under `schema`; BadRow says why there is none."""
    if schema in ("messages", "sharegpt"):
        name = config.messages_field if schema == "messages" else config.conversations_field
        messages = check_messages(required_field(record, name), name)
    elif schema == "prompt_response":
        messages = field_turns(required_field(record, config.prompt_field), config.prompt_field, "user")
        messages.append({"role": "assistant", "content": string_field(record, config.response_field)})
    elif schema == "prompt_completion":
        messages = field_turns(required_field(record, config.prompt_field), config.prompt_field, "user")
        messages += field_turns(required_field(record, config.completion_field), config.completion_field, "assistant")
    elif schema == "alpaca":
        instruction = string_field(record, config.instruction_field)
        extra = record.get(config.input_field)
        if extra is not None and not isinstance(extra, str):
            raise BadRow("non_string_content", f"{config.input_field!r} must be a string, got {shown(extra)}")
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


def as_written(bad: BadRow, file: RecordFile, index: int, judge: Callable[[Any], Any]) -> BadRow:
    """`bad`, row `index`'s problem, told again from the row as written in a JSON file: `datasets` fills absent
    fields with null, so only the file says whether a missing field is null or absent."""
    if bad.reason != "missing_field" or file.written is None:
        return bad
    try:
        judge(file.written(index))
    except BadRow as exact:
        return exact
    return bad  # not expected: the row as written holds the same values


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
    that load them, config.on_bad_row what a BadRow does (raise a DataError naming file, line, reason and
    schema, or skip and count, warning through `logger`); `detect(columns, config, label)` gives each file's
    schema."""
    fmt, files = resolve_sources(config, sources)
    items: list[T] = []
    skipped: Counter[str] = Counter()
    rows = 0
    for source in files:
        file = read_records(fmt, source, config.num_proc)
        schema = detect(file.columns, config, file.label)
        for index, (record, where) in enumerate(zip(file.rows, file.where)):
            try:
                items.append(convert(record, schema, where))
            except BadRow as error:
                bad = as_written(error, file, index, lambda row, s=schema, w=where: convert(row, s, w))
                if config.on_bad_row == "error":
                    raise DataError(
                        f"{where}: {bad.problem} ({bad.reason}; schema {schema}); fix the row or set on_bad_row: skip"
                    ) from None
                if not skipped[bad.reason]:
                    logger.warning("%s: skipping bad rows; first %s: %s: %s", split, bad.reason, where, bad.problem)
                skipped[bad.reason] += 1
        rows += len(file.rows)
    if skipped:
        logger.warning(
            "%s: skipped %d of %d rows: %s", split, sum(skipped.values()), rows, dict(sorted(skipped.items()))
        )
    return items, {"rows_read": rows, "skipped": dict(sorted(skipped.items()))}


def load_conversations(
    config: Any, sources: Sequence[str], split: str = "train"
) -> tuple[list[Conversation], dict[str, Any]]:
    """Every good row of `sources` as a Conversation, plus {rows_read, skipped: {reason: count}}."""

    def convert(record: Mapping[str, Any], schema: str, where: str) -> Conversation:
        check_tools(record.get("tools"))
        return Conversation(record_to_messages(record, schema, config), record, where)

    return load_rows(config, sources, split, detect_schema, convert)


def hold_out(conversations: list, config: Any) -> tuple[list, list]:
    """(train, val): a seeded choice of round(val_fraction * n) (at least 1) examples for validation."""
    if config.val_fraction == 0:
        return list(conversations), []
    try:
        is_val = choose_val(len(conversations), config)  # the seeded choice prepare makes
    except ValueError:
        raise ValueError(
            f"cannot hold out val_fraction={config.val_fraction} of {len(conversations)} train examples and keep "
            "any for training: add data, lower val_fraction (0 disables validation) or give val files"
        ) from None
    train = [c for c, v in zip(conversations, is_val) if not v]
    val = [c for c, v in zip(conversations, is_val) if v]
    return train, val
