"""
Preference pairs for the reward model: records -> (prompt, chosen, rejected) chats -> token ids -> batches.

Schemas (auto-detected from the columns, or set with `schema`):

    pairs   {"prompt", "chosen", "rejected"}: prompt is a string (one user turn) or a message list; chosen and
            rejected are strings (the assistant reply) or message lists (the assistant turn(s) after the prompt;
            a list that repeats the prompt first, as UltraFeedback-binarized writes it, has that part removed).
    hh      Anthropic HH-RLHF {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "..."}: two full
            transcripts. Their longest shared prefix of turns is the prompt (Human -> user, Assistant ->
            assistant) and each side's remaining turn, its final Assistant turn, is the reply.

Loading goes through Hugging Face `datasets` one file at a time (data/sft.py's loaders), so every problem names
its file and row. Bad rows raise or are skipped and counted per reason (on_bad_row). Pairs whose replies are
empty or identical carry no preference and are always dropped (counted).

Encoding: each side is `Tokenizer.encode_chat(prompt + reply)`, so it ends with the reply's <|eot_id|>, the
token the reward is read at. A side longer than seq_len has its prompt cut from the LEFT (too_long: truncate;
<|begin_of_text|> stays first, the reply and its <|eot_id|> stay whole; both sides keep the same prompt tokens
so they differ only in the reply), or the pair is dropped (too_long: drop, or the reply alone does not fit).

Batches (B pairs, T = the longest side rounded up to a multiple of 8, or seq_len with pad_to_seq_len):
    input_ids     (2B, T) long   rows [chosen_0 .. chosen_{B-1}, rejected_0 .. rejected_{B-1}], right-padded
    document_ids  (2B, T) long   0 on real tokens, 1 on padding: padding is a document of its own, so no real
                                 token ever attends to it and a side's scores do not depend on it
    score_index   (2B,)   long   position of each side's last real token (its <|eot_id|>)
    pair_mask     (B,)    bool   False on the empty slots that even out validation batches across ranks
    step_pairs    ()      float  pairs in the whole optimizer step (all ranks, all accumulation micro-batches)
Training micro-batches come from data/sft.py's SFTBatchPlan over pairs (one "row" = one pair), so the step
layout, resumption and step totals are the SFT stage's.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from data.prepare import normalize_dataclass
from data.sft import (  # SFT's loaders and row checks: the same files, errors and bad-row reasons
    BadRow,
    _check_messages,
    _field,
    _string_field,
    _type,
    encode_chats,
    hold_out,
    load_rows,
)
from data.tokenizer import Tokenizer

log = logging.getLogger("lantern.rm")

SCHEMAS = ("auto", "pairs", "hh")
FORMATS = ("auto", "json", "jsonl", "parquet", "hub")
TOO_LONG = ("truncate", "drop")
ON_BAD_ROW = ("error", "skip")
PAD_MULTIPLE = 8  # batches are padded to a multiple of this: fewer distinct shapes, friendlier kernels

Messages = list[dict[str, str]]


@dataclass
class PreferenceDataConfig:
    train: list[str]  # files / globs (json, jsonl, parquet), or one hub dataset name with format: hub
    val: list[str] = field(default_factory=list)  # empty: hold out val_fraction of the train pairs
    val_fraction: float = 0.05
    format: str = "auto"  # auto (by extension) | json | jsonl | parquet | hub
    schema: str = "auto"  # auto (from the columns) | pairs | hh
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_prompt: str | None = None  # prepended as a system turn to prompts that have none
    tokenizer: str = "default"
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
    def bad(message: str) -> ValueError:
        return ValueError(f"preference data config: {message}")

    if not config.train:
        raise bad("`train` is empty; give at least one file, glob or hub dataset name")
    for key, allowed in (("format", FORMATS), ("schema", SCHEMAS), ("too_long", TOO_LONG), ("on_bad_row", ON_BAD_ROW)):
        if getattr(config, key) not in allowed:
            raise bad(f"{key} must be one of {', '.join(allowed)}, got {getattr(config, key)!r}")
    if config.seq_len < 2:
        raise bad(f"seq_len must be >= 2, got {config.seq_len}")
    if not 0.0 <= config.val_fraction < 1.0:
        raise bad(f"val_fraction must be in [0, 1), got {config.val_fraction}")
    if config.num_proc < 1:
        raise bad(f"num_proc must be >= 1, got {config.num_proc}")


# -----------------------------------------------------------------------------
# records -> chats


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
        return _check_messages(value, name)
    raise BadRow("non_string_content", f"{name!r} must be a string or a list of messages, got {_type(value)}")


def _reply(value: Any, name: str, prompt: Messages) -> Messages:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list):
        raise BadRow("non_string_content", f"{name!r} must be a string or a list of messages, got {_type(value)}")
    turns = _check_messages(value, name)
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
        prompt = _prompt(_field(record, config.prompt_field), config.prompt_field)
        chosen = _reply(_field(record, config.chosen_field), config.chosen_field, prompt)
        rejected = _reply(_field(record, config.rejected_field), config.rejected_field, prompt)
    elif schema == "hh":
        chosen_text = _string_field(record, config.chosen_field)
        prompt, chosen, rejected = hh_to_pair(chosen_text, _string_field(record, config.rejected_field), config)
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

    return load_rows(config, sources, split, detect_schema, convert, log)  # data/sft.py's loop, logged as RM


def _stripped(turns: Messages) -> list[tuple[str, str]]:
    return [(m["role"], m["content"].strip()) for m in turns]  # encode_chat strips content too


def drop_uninformative(chats: Sequence[PreferenceChat]) -> tuple[list[PreferenceChat], dict[str, int]]:
    """Pairs without a preference to learn: an empty reply on either side, or the same reply twice."""
    kept, counts = [], {"dropped_empty": 0, "dropped_identical": 0}

    def empty(turns: Messages) -> bool:
        return not turns or any(m["role"] == "assistant" and not m["content"].strip() for m in turns)

    for chat in chats:
        if empty(chat.chosen) or empty(chat.rejected):
            counts["dropped_empty"] += 1
        elif _stripped(chat.chosen) == _stripped(chat.rejected):
            counts["dropped_identical"] += 1
        else:
            kept.append(chat)
    return kept, counts


# -----------------------------------------------------------------------------
# encoding


def fit_prompt(prompt: list[int], longest_reply: int, seq_len: int, too_long: str) -> tuple[list[int] | None, bool]:
    """(prompt ids to use, truncated?): the prompt as is when prompt + the longer reply fits seq_len; else None
    (drop) or the prompt cut from the left, <|begin_of_text|> kept first. None too when the reply cannot fit."""
    if len(prompt) + longest_reply <= seq_len:
        return prompt, False
    room = seq_len - longest_reply  # tokens left for the prompt, <|begin_of_text|> included
    if too_long == "drop" or room < 1:
        return None, False
    return prompt[:1] + (prompt[len(prompt) - (room - 1) :] if room > 1 else []), True


class PreferencePairs:
    """Encoded pairs; `batch(indices)` builds a micro-batch (see the module docstring), index -1 = empty slot.

    Also the row source SFTBatchPlan reads: len(), seq_len, row_tokens, row_examples (one pair per "row")
    and fingerprint()."""

    def __init__(
        self,
        chosen: list[np.ndarray],
        rejected: list[np.ndarray],
        where: list[str],
        seq_len: int,
        pad_id: int,
        pad_to_seq_len: bool = False,
    ):
        self.chosen, self.rejected, self.where = chosen, rejected, where
        self.seq_len, self.pad_id, self.pad_to_seq_len = seq_len, pad_id, pad_to_seq_len
        self.row_tokens = np.array([len(c) + len(r) for c, r in zip(chosen, rejected)], dtype=np.int64)
        self.row_examples = np.ones(len(chosen), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.chosen)

    def subset(self, indices: Sequence[int]) -> PreferencePairs:
        chosen, rejected, where = ([items[i] for i in indices] for items in (self.chosen, self.rejected, self.where))
        return PreferencePairs(chosen, rejected, where, self.seq_len, self.pad_id, self.pad_to_seq_len)

    def fingerprint(self) -> str:
        """Identifies the pairs, so a resumed stream can tell its data changed."""
        digest = hashlib.sha256()
        for side in (*self.chosen, *self.rejected):
            digest.update(side.tobytes())
        return digest.hexdigest()[:16]

    def batch(self, indices: Sequence[int], step_pairs: float) -> dict[str, torch.Tensor]:
        empty = np.zeros(0, dtype=np.int64)
        sides = [self.chosen[i] if i >= 0 else empty for i in indices]
        sides += [self.rejected[i] if i >= 0 else empty for i in indices]
        lengths = np.array([len(s) for s in sides], dtype=np.int64)
        longest = max(int(lengths.max()), 1)
        T = self.seq_len if self.pad_to_seq_len else min(self.seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        input_ids = torch.full((len(sides), T), self.pad_id, dtype=torch.long)
        document_ids = torch.ones((len(sides), T), dtype=torch.long)
        for row, side in enumerate(sides):
            input_ids[row, : len(side)] = torch.from_numpy(side)
            document_ids[row, : len(side)] = 0
        return {
            "input_ids": input_ids,
            "document_ids": document_ids,
            "score_index": torch.from_numpy(np.maximum(lengths - 1, 0)),
            "pair_mask": torch.tensor([i >= 0 for i in indices], dtype=torch.bool),
            "step_pairs": torch.tensor(float(step_pairs), dtype=torch.float32),
        }


def encode_pairs(
    chats: Sequence[PreferenceChat], tokenizer: Tokenizer, config: PreferenceDataConfig
) -> tuple[PreferencePairs, dict[str, int]]:
    """Each side as encode_chat(prompt + reply), fitted to seq_len; returns (pairs, counts)."""
    # encode_chat is <|begin_of_text|> followed by each turn's tokens on their own, so a side is the prompt's
    # ids followed by the reply's ids without their <|begin_of_text|>: a long prompt is encoded once, not twice.
    conversations = [turns for chat in chats for turns in (chat.prompt, chat.chosen, chat.rejected)]
    encoded = encode_chats(tokenizer, conversations, config.num_proc)
    chosen, rejected, where = [], [], []
    counts = {"truncated": 0, "dropped_too_long": 0}
    for k, chat in enumerate(chats):
        (prompt, _), (chosen_ids, _), (rejected_ids, _) = encoded[3 * k : 3 * k + 3]
        chosen_reply, rejected_reply = chosen_ids[1:], rejected_ids[1:]
        longest = max(len(chosen_reply), len(rejected_reply))
        prompt, truncated = fit_prompt(prompt, longest, config.seq_len, config.too_long)
        if prompt is None:
            counts["dropped_too_long"] += 1
            continue
        counts["truncated"] += truncated
        chosen.append(np.asarray(prompt + chosen_reply, dtype=np.int64))
        rejected.append(np.asarray(prompt + rejected_reply, dtype=np.int64))
        where.append(chat.where)
    return PreferencePairs(chosen, rejected, where, config.seq_len, tokenizer.pad_id, config.pad_to_seq_len), counts


# -----------------------------------------------------------------------------
# everything together


@dataclass
class PreferenceData:
    train: PreferencePairs
    val: PreferencePairs | None
    stats: dict[str, Any]


def _prepare(
    chats: list[PreferenceChat], tokenizer: Tokenizer, config: PreferenceDataConfig
) -> tuple[PreferencePairs, dict[str, Any]]:
    kept, drop_counts = drop_uninformative(chats)
    pairs, fit_counts = encode_pairs(kept, tokenizer, config)
    sides = pairs.row_tokens / 2 if len(pairs) else np.zeros(1)
    stats = {
        "chats": len(chats),
        **drop_counts,
        **fit_counts,
        "pairs": len(pairs),
        "mean_side_tokens": float(sides.mean()),
    }
    return pairs, stats


def build_preference_data(
    config: PreferenceDataConfig | Mapping[str, Any], tokenizer: Tokenizer | None = None
) -> PreferenceData:
    """Load, convert, filter and encode the train and val pairs (see the module docstring)."""
    config = normalize_config(config)
    tokenizer = tokenizer or Tokenizer.load(config.tokenizer)
    chats, train_load = load_chats(config, config.train, "train")
    train, train_stats = _prepare(chats, tokenizer, config)
    stats: dict[str, Any] = {"seq_len": config.seq_len, "train": {**train_load, **train_stats}}
    if config.val:
        val_chats, val_load = load_chats(config, config.val, "val")
        val, val_stats = _prepare(val_chats, tokenizer, config)
        stats["val"] = {**val_load, **val_stats}
    else:
        # Held out after filtering and encoding, so val_fraction is a share of usable pairs; seeded, so the
        # same data and seed always give the same split.
        train_index, val_index = hold_out(list(range(len(train))), config)
        train, val = train.subset(train_index), train.subset(val_index)
        stats["train"]["pairs"] = len(train)
        stats["val"] = {"held_out_from_train": len(val), "pairs": len(val)}
    if len(train) == 0:
        raise ValueError(f"no usable train pairs in {config.train}: {stats['train']}")
    return PreferenceData(train=train, val=val if len(val) else None, stats=stats)


def log_summary(stats: dict[str, Any]) -> None:
    for name in ("train", "val"):
        s = stats.get(name)
        if not s:
            continue
        if "rows_read" not in s:
            log.info("RM %s: %d pairs held out from train", name, s["pairs"])
            continue
        log.info(
            "RM %s: %d rows read, skipped %s; dropped %d with an empty reply, %d with identical replies, %d too long; "
            "%d prompts truncated; %d pairs (%.1f tokens per side on average, seq_len %d)",
            name,
            s["rows_read"],
            s["skipped"],
            s["dropped_empty"],
            s["dropped_identical"],
            s["dropped_too_long"],
            s["truncated"],
            s["pairs"],
            s["mean_side_tokens"],
            stats["seq_len"],
        )


# -----------------------------------------------------------------------------
# datasets for loaders


class PreferenceTrainBatches(Dataset):
    """Micro-batches by SFTBatchPlan item (pair indices, step_tokens, step_pairs):
    DataLoader(batch_size=None, sampler=plan)."""

    def __init__(self, pairs: PreferencePairs):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, item: tuple) -> dict[str, torch.Tensor]:
        indices, _, step_pairs = item
        return self.pairs.batch(indices, step_pairs)


class PreferenceEvalBatches(Dataset):
    """One rank's micro-batches over all pairs, in order (validation, the reward-normalisation pass): batch b
    holds pairs b*W*B + [0, W*B), rank r the slots b*W*B + r*B + [0, B). Slots past the end are empty
    (pair_mask False), so every rank runs the same number of forwards, as FSDP's collectives need."""

    def __init__(self, pairs: PreferencePairs, micro_batch_size: int, rank: int = 0, world_size: int = 1):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.pairs, self.micro_batch_size, self.rank, self.world_size = pairs, micro_batch_size, rank, world_size
        self.per_batch = micro_batch_size * world_size
        self.num_batches = -(-len(pairs) // self.per_batch)

    def __len__(self) -> int:
        return self.num_batches

    def slots(self, index: int, rank: int) -> list[int]:
        first = index * self.per_batch + rank * self.micro_batch_size
        return [s if s < len(self.pairs) else -1 for s in range(first, first + self.micro_batch_size)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range for {self.num_batches}")
        real = min(self.per_batch, len(self.pairs) - index * self.per_batch)
        return self.pairs.batch(self.slots(index, self.rank), step_pairs=real)
