"""
SFT examples: conversations -> token ids with a supervised mask, fitted to seq_len, with upsampling counts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from data.pretrain.workers import workers_die_with_this_process
from data.records.chat import Conversation
from data.sft.config import SFTDataConfig
from data.tokenizer.tokenizer import Tokenizer
from models.loss import IGNORE_INDEX

log = logging.getLogger("lantern.sft")


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
