"""
Supervised fine-tuning data: chat records -> encoded examples -> fixed-length rows -> an exact batch plan.

Pipeline (build_sft_data):

1. load      JSON / JSON lines / Parquet files (globs) or a hub dataset through Hugging Face `datasets`
             (input resolution and loading are data/prepare.py's), one file at a time so every problem
             names its file and row.
2. map       each row to chat messages by schema: "messages" (a list of {role, content}), "prompt_response"
             (prompt: a string or a message list; response: the assistant answer) or "alpaca" (instruction
             [+ "\\n\\n" + input] -> user, output -> assistant); an optional system prompt is prepended to
             rows without a system turn. Bad rows raise a ValueError naming file and row, or are skipped and
             counted per reason (on_bad_row=skip). Nothing is repaired silently.
3. encode    with Tokenizer.encode_chat; `supervised` marks the assistant turns' content + <|eot_id|> (or
             everything with train_on_prompt). Too long examples are truncated or dropped, both counted.
4. upsample  (train only) short-answer examples, by a repeat factor or up to a target share of examples.
5. rows      of exactly seq_len tokens: first-fit-decreasing packing of whole examples (packing=True) or one
             example per row; inputs padded with pad_id, targets with -100. document_ids number the
             examples of a row 0, 1, ...; padding gets the next id, so it is a document of its own.
6. plan      a global, seeded stream of rows (data/packed.py's StreamSampler positions). Optimizer step s
             takes positions [s*G, (s+1)*G), G = world_size * accumulate * micro_batch_size; rank r's
             micro-batch j of that step takes s*G + (j*world_size + r)*micro_batch_size + [0, micro_batch_size).
             Every micro-batch carries the step's totals over all G rows (step_tokens, step_examples), so a
             loss normalised by them is the same for 1 x 8, 8 x 1 and 2 ranks x 4.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import multiprocessing
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from data.packed import IGNORE_INDEX, StreamSampler
from data.prepare import PrepareConfig, _choose_val, _json_rows, _load, normalize_dataclass, resolve_inputs
from data.tokenizer import CHAT_ROLES, Tokenizer
from models.errors import DataError

log = logging.getLogger("lantern.sft")
T = TypeVar("T")

SCHEMAS = ("auto", "messages", "prompt_response", "alpaca")
FORMATS = ("auto", "json", "jsonl", "parquet", "hub")
TOO_LONG = ("truncate", "drop")
ON_BAD_ROW = ("error", "skip")
BAD_ROW_REASONS = (
    "missing_field",  # a mapped field (or a message's role / content) is absent or null
    "empty_assistant",  # an assistant turn whose content is only whitespace
    "not_ending_with_assistant",  # nothing to answer: the conversation is empty or ends with another role
    "unknown_role",  # a role the chat template does not know
    "non_string_content",  # content (or prompt / response / instruction / input / output) that is not a string
    "malformed",  # wrong structure: messages that are not a list of objects
)
KIND_IDS = {"short": 0, "long": 1}  # example_kinds values in validation batches; padding is -1


@dataclass
class SFTDataConfig:
    train: list[str]  # files / globs (json, jsonl, parquet), or one hub dataset name with format: hub
    val: list[str] = field(default_factory=list)  # empty: hold out val_fraction of the train examples
    val_fraction: float = 0.05
    format: str = "auto"  # auto (by extension) | json | jsonl | parquet | hub
    schema: str = "auto"  # auto (from the columns) | messages | prompt_response | alpaca
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    system_prompt: str | None = None  # prepended as a system turn to rows that have none
    tokenizer: str = "default"
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
    def bad(message: str) -> ValueError:
        return ValueError(f"SFT data config: {message}")

    if not config.train:
        raise bad("`train` is empty; give at least one file, glob or hub dataset name")
    if config.format not in FORMATS:
        raise bad(f"unknown format {config.format!r}; expected one of {', '.join(FORMATS)}")
    if config.schema not in SCHEMAS:
        raise bad(f"unknown schema {config.schema!r}; expected one of {', '.join(SCHEMAS)}")
    if config.too_long not in TOO_LONG:
        raise bad(f"too_long must be one of {', '.join(TOO_LONG)}, got {config.too_long!r}")
    if config.on_bad_row not in ON_BAD_ROW:
        raise bad(f"on_bad_row must be one of {', '.join(ON_BAD_ROW)}, got {config.on_bad_row!r}")
    if config.seq_len < 1:
        raise bad(f"seq_len must be >= 1, got {config.seq_len}")
    if not 0.0 <= config.val_fraction < 1.0:
        raise bad(f"val_fraction must be in [0, 1), got {config.val_fraction}")
    if config.short_answer_max_tokens < 1:
        raise bad(f"short_answer_max_tokens must be >= 1, got {config.short_answer_max_tokens}")
    if config.short_answer_factor < 1:
        raise bad(f"short_answer_factor must be >= 1, got {config.short_answer_factor}")
    share = config.short_answer_target_share
    if share is not None:
        if not 0.0 <= share < 1.0:
            raise bad(f"short_answer_target_share must be in [0, 1) or null, got {share}")
        if config.short_answer_factor != 1:
            raise bad("set short_answer_factor or short_answer_target_share, not both")
    if config.num_proc < 1:
        raise bad(f"num_proc must be >= 1, got {config.num_proc}")


# -----------------------------------------------------------------------------
# loading: files -> records -> conversations


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
    """(format, files) for `sources`, or ("hub", [name]): data/prepare.py's resolution, SFT formats only."""
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
            ds = _load(fmt, [source], settings, cache_dir=cache_dir)
        except DataError:  # already names the file and line
            raise
        except ValueError as error:
            if fmt == "json":  # name the broken line ourselves: prepare's diagnosis looks for a text field
                for where, record in _json_rows(source):
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


def _type(value: Any) -> str:
    return type(value).__name__


def _field(record: Mapping[str, Any], name: str) -> Any:
    value = record.get(name)
    if value is None:  # absent, or null (datasets fills absent columns with null)
        raise BadRow("missing_field", f"no {name!r} field")
    return value


def _string_field(record: Mapping[str, Any], name: str) -> str:
    value = _field(record, name)
    if not isinstance(value, str):
        raise BadRow("non_string_content", f"{name!r} must be a string, got {_type(value)}")
    return value


def _check_messages(messages: Any, name: str) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise BadRow("malformed", f"{name!r} must be a list of messages, got {_type(messages)}")
    checked = []
    for index, message in enumerate(messages):
        where = f"{name}[{index}]"
        if not isinstance(message, Mapping):
            raise BadRow("malformed", f"{where} must be an object with 'role' and 'content', got {_type(message)}")
        role, content = message.get("role"), message.get("content")
        if role is None:
            raise BadRow("missing_field", f"{where} has no 'role'")
        if role not in CHAT_ROLES:
            raise BadRow("unknown_role", f"{where} has unknown role {role!r}; allowed: {', '.join(CHAT_ROLES)}")
        if content is None:
            raise BadRow("missing_field", f"{where} ({role}) has no 'content'")
        if not isinstance(content, str):
            raise BadRow("non_string_content", f"{where} ({role}) content must be a string, got {_type(content)}")
        checked.append({"role": role, "content": content})
    return checked


def record_to_messages(record: Mapping[str, Any], schema: str, config: SFTDataConfig) -> list[dict[str, str]]:
    """The conversation a row holds under `schema`; BadRow says why there is none."""
    if schema == "messages":
        messages = _check_messages(_field(record, config.messages_field), config.messages_field)
    elif schema == "prompt_response":
        prompt = _field(record, config.prompt_field)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            messages = _check_messages(prompt, config.prompt_field)
        else:
            raise BadRow(
                "non_string_content",
                f"{config.prompt_field!r} must be a string or a list of messages, got {_type(prompt)}",
            )
        messages.append({"role": "assistant", "content": _string_field(record, config.response_field)})
    elif schema == "alpaca":
        instruction = _string_field(record, config.instruction_field)
        extra = record.get(config.input_field)
        if extra is not None and not isinstance(extra, str):
            raise BadRow("non_string_content", f"{config.input_field!r} must be a string, got {_type(extra)}")
        user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        output = _string_field(record, config.output_field)
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
        is_val = _choose_val(len(conversations), config)  # data/prepare.py's seeded choice
    except ValueError:
        raise ValueError(
            f"cannot hold out val_fraction={config.val_fraction} of {len(conversations)} train examples and keep "
            "any for training: add data, lower val_fraction (0 disables validation) or give val files"
        ) from None
    train = [c for c, v in zip(conversations, is_val) if not v]
    val = [c for c, v in zip(conversations, is_val) if v]
    return train, val


# -----------------------------------------------------------------------------
# encoding


@dataclass
class Example:
    ids: np.ndarray  # int64, at most seq_len + 1 ids (after truncation)
    supervised: np.ndarray  # bool per id: the id is a training target
    answer_tokens: int  # supervised tokens of the last assistant turn (content + <|eot_id|>), untruncated
    kind: str  # "short" | "long"
    conversation: Conversation
    truncated: bool = False

    @property
    def num_inputs(self) -> int:
        """Tokens the example occupies in a row: inputs ids[:-1] predict targets ids[1:]."""
        return len(self.ids) - 1

    @property
    def num_targets(self) -> int:
        return int(self.supervised[1:].sum())

    def inputs_targets(self) -> tuple[np.ndarray, np.ndarray]:
        targets = self.ids[1:].copy()
        targets[~self.supervised[1:]] = IGNORE_INDEX
        return self.ids[:-1], targets


def last_turn_tokens(mask: Sequence[bool]) -> int:
    """Length of the last run of True in `mask`: the last assistant turn's content + <|eot_id|>."""
    count, index = 0, len(mask) - 1
    while index >= 0 and not mask[index]:
        index -= 1
    while index >= 0 and mask[index]:
        count, index = count + 1, index - 1
    return count


_WORKER_TOKENIZER: Tokenizer | None = None
_PARALLEL_MIN_CHARS = 4_000_000


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _encode_chunk(chunk: list[list[dict[str, str]]]) -> list[tuple[list[int], list[bool]]]:
    return [_WORKER_TOKENIZER.encode_chat(messages) for messages in chunk]


def encode_chats(
    tokenizer: Tokenizer, conversations: Sequence[list[dict[str, str]]], num_proc: int = 1
) -> list[tuple[list[int], list[bool]]]:
    """tokenizer.encode_chat over many conversations, in num_proc processes when there are many."""
    chars = sum(len(m["content"]) for messages in conversations for m in messages)
    if num_proc <= 1 or chars < _PARALLEL_MIN_CHARS:  # below that, starting processes costs more than it saves
        return [tokenizer.encode_chat(messages) for messages in conversations]
    size = math.ceil(len(conversations) / (4 * num_proc))
    chunks = [list(conversations[i : i + size]) for i in range(0, len(conversations), size)]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(
        num_proc, mp_context=multiprocessing.get_context(method), initializer=_init_worker, initargs=(tokenizer,)
    ) as pool:
        return [pair for part in pool.map(_encode_chunk, chunks) for pair in part]


def encode_conversation(conversation: Conversation, config: SFTDataConfig, ids: list[int], mask: list[bool]) -> Example:
    answer = last_turn_tokens(mask)
    supervised = np.ones(len(ids), dtype=bool) if config.train_on_prompt else np.asarray(mask, dtype=bool)
    return Example(
        ids=np.asarray(ids, dtype=np.int64),
        supervised=supervised,
        answer_tokens=answer,
        kind="short" if answer <= config.short_answer_max_tokens else "long",
        conversation=conversation,
    )


def encode_examples(
    conversations: Sequence[Conversation], tokenizer: Tokenizer, config: SFTDataConfig
) -> list[Example]:
    pairs = encode_chats(tokenizer, [c.messages for c in conversations], config.num_proc)
    return [encode_conversation(c, config, ids, mask) for c, (ids, mask) in zip(conversations, pairs)]


def fit_to_length(examples: Sequence[Example], seq_len: int, too_long: str) -> tuple[list[Example], dict[str, int]]:
    """Examples that fit a row of seq_len inputs: longer ones truncated to their first seq_len + 1 ids or dropped
    (too_long); one left without any supervised target is dropped. Returns (kept, counts)."""
    kept, counts = [], {"truncated": 0, "dropped_too_long": 0, "dropped_no_target": 0}
    for example in examples:
        if len(example.ids) > seq_len + 1:
            if too_long == "drop":
                counts["dropped_too_long"] += 1
                continue
            example = dataclasses.replace(
                example, ids=example.ids[: seq_len + 1], supervised=example.supervised[: seq_len + 1], truncated=True
            )
            counts["truncated"] += 1
        if example.num_targets == 0:
            counts["dropped_no_target"] += 1
            continue
        kept.append(example)
    return kept, counts


# -----------------------------------------------------------------------------
# short-answer upsampling


def upsample_short(examples: Sequence[Example], config: SFTDataConfig) -> tuple[np.ndarray, dict[str, int]]:
    """Copies of each example (an int array): short-answer examples `short_answer_factor` times, or, with
    short_answer_target_share, as evenly as possible (the remainder a seeded choice) until short examples
    are that share of all examples. Never fewer than one copy. Returns (copies, counts before / after)."""
    short = np.array([e.kind == "short" for e in examples], dtype=bool)
    copies = np.ones(len(examples), dtype=np.int64)
    n_short, n_long = int(short.sum()), int((~short).sum())
    share = config.short_answer_target_share
    if share is not None:
        wanted = round(share * n_long / (1.0 - share))
        if n_short == 0 and wanted > 0:
            log.warning("short_answer_target_share=%s: there are no short-answer examples to upsample", share)
        elif wanted > n_short:
            base, extra = divmod(wanted, n_short)
            short_index = np.flatnonzero(short)
            copies[short_index] = base
            rng = np.random.default_rng([config.seed, 0x5F7])  # own stream, independent of the val hold-out
            copies[rng.choice(short_index, size=extra, replace=False)] += 1
    elif config.short_answer_factor > 1:
        copies[short] = config.short_answer_factor
    counts = {
        "examples_before": len(examples),
        "short_before": n_short,
        "examples_after": int(copies.sum()),
        "short_after": int(copies[short].sum()),
    }
    return copies, counts


# -----------------------------------------------------------------------------
# rows


def pack_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each holding at most `capacity`: items by decreasing length (ties by index) go
    into the first bin with room. O(n log n) via a max-tree over the bins' free space."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return []
    if lengths.min() < 1 or lengths.max() > capacity:
        raise ValueError(f"item lengths must be in [1, {capacity}], got [{lengths.min()}, {lengths.max()}]")
    order = np.argsort(-lengths, kind="stable")
    size = 1 << max(0, (len(lengths) - 1).bit_length())  # leaves: at most one bin per item
    free = [capacity] * (2 * size)  # free[node] = most free space in the node's bins
    bins: list[list[int]] = []
    for item in order.tolist():
        need = int(lengths[item])
        node = 1
        while node < size:  # leftmost bin with room (a new, empty bin at worst)
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        index = node - size
        if index == len(bins):
            bins.append([])
        bins[index].append(item)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


class SFTRows:
    """Examples laid out in rows of exactly seq_len tokens; row i is built on demand by row(i).

    Row i holds examples rows[i] (indices into `examples`; an index may repeat after upsampling) back to
    back: inputs ids[:-1], targets ids[1:] (-100 where not supervised), document ids 0, 1, ..., then
    padding (pad_id / -100 / document id = number of examples). Row index -1 is an all-padding row."""

    def __init__(self, examples: Sequence[Example], rows: Sequence[Sequence[int]], seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.num_examples = len(examples)
        sizes = np.array([e.num_inputs for e in examples], dtype=np.int64)
        self.offsets = np.zeros(len(examples) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.offsets[1:])
        pairs = [e.inputs_targets() for e in examples]
        self.inputs = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0, np.int64)
        self.targets = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.int64)
        self.kinds = np.array([KIND_IDS[e.kind] for e in examples], dtype=np.int64)
        example_targets = np.array([e.num_targets for e in examples], dtype=np.int64)

        self.row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=self.row_offsets[1:])
        self.row_items = np.array([i for r in rows for i in r], dtype=np.int64)
        row_of_item = np.repeat(np.arange(len(rows)), np.diff(self.row_offsets))
        self.row_lengths = np.bincount(row_of_item, weights=sizes[self.row_items], minlength=len(rows)).astype(np.int64)
        if len(rows) and self.row_lengths.max() > seq_len:
            raise ValueError(f"a row holds {self.row_lengths.max()} tokens, more than seq_len={seq_len}")
        # Per row: supervised targets and examples with at least one (the step totals add these up).
        self.row_tokens = np.bincount(row_of_item, weights=example_targets[self.row_items], minlength=len(rows)).astype(
            np.int64
        )
        self.row_examples = np.bincount(
            row_of_item, weights=(example_targets[self.row_items] > 0), minlength=len(rows)
        ).astype(np.int64)

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def real_tokens(self) -> int:
        return int(self.row_lengths.sum())

    @property
    def supervised_tokens(self) -> int:
        return int(self.row_tokens.sum())

    @property
    def efficiency(self) -> float:
        """Real (non-padding) tokens over rows x seq_len."""
        return self.real_tokens / (len(self) * self.seq_len) if len(self) else 0.0

    def examples_in(self, row: int) -> list[int]:
        return self.row_items[self.row_offsets[row] : self.row_offsets[row + 1]].tolist()

    def fingerprint(self) -> str:
        """Identifies the row layout, so a resumed stream can tell its rows changed."""
        digest = hashlib.sha256()
        for array in (self.row_offsets, self.row_lengths, self.row_tokens):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()[:16]

    def row(self, index: int) -> dict[str, np.ndarray]:
        T = self.seq_len
        input_ids = np.full(T, self.pad_id, dtype=np.int64)
        targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
        document_ids = np.zeros(T, dtype=np.int64)
        kinds = np.full(T, -1, dtype=np.int64)
        pos = doc = 0
        if index >= 0:
            for doc, example in enumerate(self.examples_in(index)):
                lo, hi = self.offsets[example], self.offsets[example + 1]
                n = int(hi - lo)
                input_ids[pos : pos + n] = self.inputs[lo:hi]
                targets[pos : pos + n] = self.targets[lo:hi]
                document_ids[pos : pos + n] = doc
                kinds[pos : pos + n] = self.kinds[example]
                pos += n
            doc = len(self.examples_in(index))
        document_ids[pos:] = doc  # padding: a document of its own
        return {"input_ids": input_ids, "targets": targets, "document_ids": document_ids, "example_kinds": kinds}

    def batch(self, indices: Sequence[int], with_kinds: bool = False) -> dict[str, torch.Tensor]:
        rows = [self.row(int(i)) for i in indices]
        keys = ("input_ids", "targets", "document_ids") + (("example_kinds",) if with_kinds else ())
        return {key: torch.from_numpy(np.stack([r[key] for r in rows])) for key in keys}


def make_rows(
    examples: Sequence[Example], copies: np.ndarray | None, seq_len: int, pad_id: int, packing: bool
) -> SFTRows:
    """Rows of `examples` (each repeated copies[i] times): first-fit-decreasing packed, or one per row."""
    copies = np.ones(len(examples), dtype=np.int64) if copies is None else copies
    items = np.repeat(np.arange(len(examples)), copies)
    if packing:
        lengths = np.array([examples[i].num_inputs for i in items], dtype=np.int64)
        rows = [items[b].tolist() for b in pack_first_fit_decreasing(lengths, seq_len)]
    else:
        rows = [[int(i)] for i in items]
    return SFTRows(examples, rows, seq_len, pad_id)


# -----------------------------------------------------------------------------
# everything together


@dataclass
class SFTData:
    train: SFTRows
    val: SFTRows | None
    train_examples: list[Example]
    val_examples: list[Example]
    stats: dict[str, Any]


def _split_stats(rows: SFTRows, fit_counts: dict[str, int], encoded: int) -> dict[str, Any]:
    return {
        "examples": encoded,
        **fit_counts,
        "examples_kept": rows.num_examples,
        "rows": len(rows),
        "real_tokens": rows.real_tokens,
        "supervised_tokens": rows.supervised_tokens,
        "supervised_tokens_per_row": rows.supervised_tokens / len(rows) if len(rows) else 0.0,
        "packing_efficiency": rows.efficiency,
    }


def build_sft_data(config: SFTDataConfig | Mapping[str, Any], tokenizer: Tokenizer | None = None) -> SFTData:
    """Load, map, validate, encode, upsample and lay out the train and val rows (see the module docstring)."""
    config = normalize_config(config)
    tokenizer = tokenizer or Tokenizer.load(config.tokenizer)

    conversations, train_load = load_conversations(config, config.train, "train")
    if config.val:
        train_conv = conversations
        val_conv, val_load = load_conversations(config, config.val, "val")
    else:
        train_conv, val_conv = hold_out(conversations, config)
        val_load = {"held_out_from_train": len(val_conv)}
    if not train_conv:
        raise ValueError(
            f"no usable train examples in {config.train} ({train_load['rows_read']} rows read, "
            f"skipped {train_load['skipped']})"
        )

    splits: dict[str, Any] = {}
    stats: dict[str, Any] = {"seq_len": config.seq_len, "packing": config.packing}
    for name, convs, load in (("train", train_conv, train_load), ("val", val_conv, val_load)):
        encoded = encode_examples(convs, tokenizer, config)
        kept, fit_counts = fit_to_length(encoded, config.seq_len, config.too_long)
        if name == "train" and not kept:
            raise ValueError(
                f"all {len(encoded)} train examples were dropped ({fit_counts}); raise seq_len or set too_long: truncate"
            )
        copies, upsampling = upsample_short(kept, config) if name == "train" else (None, None)
        rows = make_rows(kept, copies, config.seq_len, tokenizer.pad_id, config.packing) if kept else None
        if rows is not None:
            split_stats = {**load, **_split_stats(rows, fit_counts, len(encoded))}
        else:  # no validation examples (the train split always has some, checked above)
            split_stats = {**load, "examples": len(encoded), **fit_counts, "examples_kept": 0, "rows": 0}
        if upsampling is not None:
            split_stats["upsampling"] = upsampling
        if name == "val":
            split_stats["short"] = sum(e.kind == "short" for e in kept)
        stats[name] = split_stats
        splits[name] = (rows, kept)
    return SFTData(
        train=splits["train"][0],
        val=splits["val"][0],
        train_examples=splits["train"][1],
        val_examples=splits["val"][1],
        stats=stats,
    )


def log_summary(stats: dict[str, Any]) -> None:
    for name in ("train", "val"):
        s = stats.get(name)
        if not s:
            continue
        source = (
            f"{s['rows_read']} rows read"
            if "rows_read" in s
            else f"{s.get('held_out_from_train', 0)} held out from train"
        )
        log.info(
            "SFT %s: %s, skipped %s, %d examples encoded, truncated %d, dropped %d too long + %d without a target; "
            "%d rows of %d tokens (packing=%s, efficiency %.3f), %d supervised tokens (%.1f per row)",
            name,
            source,
            s.get("skipped", {}),
            s["examples"],
            s["truncated"],
            s["dropped_too_long"],
            s["dropped_no_target"],
            s["rows"],
            stats["seq_len"],
            stats["packing"],
            s.get("packing_efficiency", 0.0),
            s.get("supervised_tokens", 0),
            s.get("supervised_tokens_per_row", 0.0),
        )
        if "upsampling" in s:
            u = s["upsampling"]
            log.info(
                "SFT train short-answer upsampling: %d of %d examples short before, %d of %d after",
                u["short_before"],
                u["examples_before"],
                u["short_after"],
                u["examples_after"],
            )


# -----------------------------------------------------------------------------
# the batch plan


class SFTBatchPlan(Sampler[tuple]):
    """One rank's micro-batches of the global step plan (see the module docstring).

    Positions of the global stream map to rows through a StreamSampler (epoch e = a permutation seeded by
    (seed, e)); `consumed` counts global positions. Each yielded item is (row indices, step_tokens,
    step_examples) for SFTTrainBatches. Iterating does not move `consumed`: report trained micro-batches with
    advance(micro_batch_size * world_size) each. len() = (num_rows // G) * accumulate micro-batches, whole steps.
    """

    def __init__(
        self,
        rows: SFTRows,
        *,
        micro_batch_size: int,
        accumulate: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if micro_batch_size < 1 or accumulate < 1:
            raise ValueError(f"micro_batch_size and accumulate must be >= 1, got {micro_batch_size}, {accumulate}")
        self.step_size = world_size * accumulate * micro_batch_size
        if len(rows) < self.step_size:
            raise ValueError(
                f"{len(rows)} train rows of {rows.seq_len} tokens are fewer than one optimizer step needs "
                f"({world_size} ranks x {accumulate} accumulation x {micro_batch_size} micro-batch = {self.step_size}); "
                "add data or lower micro_batch_size / accumulate_grad_batches"
            )
        self.stream = StreamSampler(len(rows), rank=rank, world_size=world_size, shuffle=shuffle, seed=seed)
        self.row_tokens, self.row_examples = rows.row_tokens, rows.row_examples
        self.rows_fingerprint = rows.fingerprint()
        self.micro_batch_size, self.accumulate = micro_batch_size, accumulate
        self.rank, self.world_size = rank, world_size
        self.step_anchor = 0  # steps start at step_anchor + k * step_size
        self._step_cache: tuple[int, float, float] | None = None
        self._last_iter_start: int | None = None

    @property
    def consumed(self) -> int:
        return self.stream.consumed

    @property
    def num_rows(self) -> int:
        return self.stream.num_samples

    def __len__(self) -> int:
        return (self.num_rows // self.step_size) * self.accumulate

    def step_totals(self, step_start: int) -> tuple[float, float]:
        """(supervised targets, examples with a target) over the G rows at positions step_start + [0, G)."""
        if self._step_cache is None or self._step_cache[0] != step_start:
            rows = [self.stream.index_at(step_start + i) for i in range(self.step_size)]
            self._step_cache = (step_start, float(self.row_tokens[rows].sum()), float(self.row_examples[rows].sum()))
        return self._step_cache[1], self._step_cache[2]

    def micro_batch(self, global_micro_batch: int) -> tuple[tuple[int, ...], float, float]:
        """This rank's rows of global micro-batch m (counted from the anchor), with its step's totals."""
        start = self.step_anchor + global_micro_batch * self.micro_batch_size * self.world_size
        first = start + self.rank * self.micro_batch_size
        rows = tuple(self.stream.index_at(first + i) for i in range(self.micro_batch_size))
        step_start = self.step_anchor + (start - self.step_anchor) // self.step_size * self.step_size
        return (rows, *self.step_totals(step_start))

    def __iter__(self) -> Iterator[tuple]:
        start = self.consumed
        if start == self._last_iter_start:
            log.warning(
                "SFT batch plan: a new pass starts at the same stream position %d as the previous one; report "
                "consumed micro-batches (SFTDataModule.mark_consumed) or every epoch repeats the same data",
                start,
            )
        self._last_iter_start = start
        return self._iterate(start)

    def _iterate(self, start: int) -> Iterator[tuple]:
        first = (start - self.step_anchor) // (self.micro_batch_size * self.world_size)
        for k in range(len(self)):
            yield self.micro_batch(first + k)

    def advance(self, global_positions: int) -> None:
        self.stream.advance(global_positions)

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.stream.state_dict(),
            "step_size": self.step_size,
            "step_anchor": self.step_anchor,
            "rows_fingerprint": self.rows_fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stream.load_state_dict(dict(state))  # ValueError if the number of rows changed
        self._step_cache, self._last_iter_start = None, None
        if state.get("rows_fingerprint", self.rows_fingerprint) != self.rows_fingerprint:
            log.warning(
                "SFT batch plan: resuming at position %d over rows laid out differently than in the checkpoint "
                "(same count, different contents): the data or its settings changed",
                self.consumed,
            )
        anchor = int(state.get("step_anchor", 0))
        old_step = int(state.get("step_size", self.step_size))
        per_micro_batch = self.micro_batch_size * self.world_size
        if old_step != self.step_size or (self.consumed - anchor) % per_micro_batch:
            # The step layout changed (world size, micro-batch size or accumulation): steps start afresh here.
            if (self.consumed - anchor) % old_step:
                log.warning(
                    "SFT batch plan: the checkpoint stopped mid-step and the batch layout changed; steps restart "
                    "at stream position %d",
                    self.consumed,
                )
            anchor = self.consumed
        self.step_anchor = anchor


class SFTTrainBatches(Dataset):
    """Micro-batches by SFTBatchPlan item: use with DataLoader(batch_size=None, sampler=plan)."""

    def __init__(self, rows: SFTRows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: tuple) -> dict[str, torch.Tensor]:
        rows, step_tokens, step_examples = item
        batch = self.rows.batch(rows)
        batch["step_tokens"] = torch.tensor(step_tokens, dtype=torch.float32)
        batch["step_examples"] = torch.tensor(step_examples, dtype=torch.float32)
        return batch


class SFTValBatches(Dataset):
    """Validation micro-batches of one rank, in row order: batch b holds the W*B rows (slots)
    b*W*B + [0, W*B); rank r takes slots b*W*B + r*B + [0, B). Slots past the last row are all-padding rows
    (no targets), so every rank runs the same number of equally shaped batches and no row is left out.
    Step totals are over all W*B slots of the batch."""

    def __init__(self, rows: SFTRows, micro_batch_size: int, rank: int = 0, world_size: int = 1):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.rows, self.micro_batch_size, self.rank, self.world_size = rows, micro_batch_size, rank, world_size
        self.per_batch = micro_batch_size * world_size
        self.num_batches = math.ceil(len(rows) / self.per_batch)

    def __len__(self) -> int:
        return self.num_batches

    def slots(self, index: int, rank: int) -> list[int]:
        first = index * self.per_batch + rank * self.micro_batch_size
        return [s if s < len(self.rows) else -1 for s in range(first, first + self.micro_batch_size)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_batches:
            raise IndexError(f"validation batch {index} out of range for {self.num_batches}")
        batch = self.rows.batch(self.slots(index, self.rank), with_kinds=True)
        every = [s for r in range(self.world_size) for s in self.slots(index, r) if s >= 0]
        batch["step_tokens"] = torch.tensor(float(self.rows.row_tokens[every].sum()), dtype=torch.float32)
        batch["step_examples"] = torch.tensor(float(self.rows.row_examples[every].sum()), dtype=torch.float32)
        return batch
