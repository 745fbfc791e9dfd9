"""SFT examples and rows: conversations encoded into token ids with a supervised mask, fitted to seq_len and
upsampled, then laid out in rows of exactly seq_len tokens; ``SFTDataConfig``, every setting of that pipeline, each
declaring what it accepts."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from data.pretrain.sources import workers_die_with_this_process
from data.records.chat import Conversation
from data.tokenizer.chat_template import ChatTemplateError
from data.tokenizer.tokenizer import Tokenizer
from models.config_checks import bounded
from models.errors import ConfigError, DataError
from models.loss import IGNORE_INDEX

log = logging.getLogger("lantern.sft")


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


def _encode_chunk(chunk: list[tuple[list[dict[str, str]], Any]]) -> list[tuple[list[int], list[bool]]]:
    return [_WORKER_TOKENIZER.encode_chat(messages, tools) for messages, tools in chunk]


def encode_chats(
    tokenizer: Tokenizer,
    conversations: Sequence[list[dict[str, str]]],
    num_proc: int = 1,
    tools: Sequence[list[dict[str, Any]] | None] | None = None,
) -> list[tuple[list[int], list[bool]]]:
    """tokenizer.encode_chat over many conversations (``tools``: each one's offered tools, or None), in num_proc
    processes when there are many."""
    jobs = list(zip(conversations, tools if tools is not None else [None] * len(conversations)))
    chars = sum(len(m["content"]) for messages in conversations for m in messages)
    if num_proc <= 1 or chars < _PARALLEL_MIN_CHARS:  # below that, starting processes costs more than it saves
        return [tokenizer.encode_chat(messages, offered) for messages, offered in jobs]
    size = math.ceil(len(jobs) / (4 * num_proc))
    chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with (
        workers_die_with_this_process(),  # a kill -9 of this process ends them too
        ProcessPoolExecutor(
            num_proc, mp_context=multiprocessing.get_context(method), initializer=_init_worker, initargs=(tokenizer,)
        ) as pool,
    ):
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
    try:
        messages, tools = [c.messages for c in conversations], [c.tools for c in conversations]
        pairs = encode_chats(tokenizer, messages, config.num_proc, tools)
    except ChatTemplateError:
        for conversation in conversations:  # the error path only: which row the template fails on
            try:
                tokenizer.encode_chat(conversation.messages, conversation.tools)
            except ChatTemplateError as error:
                raise DataError(f"{conversation.where}: the chat template cannot render this row ({error})") from None
        raise
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


KIND_IDS = {"short": 0, "long": 1}  # example_kinds values in validation batches; padding is -1


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
