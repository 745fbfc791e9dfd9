"""
Preference pairs for the reward model: chats -> filtered, encoded pairs -> batches (build_preference_data).

Encoding: each side is `Tokenizer.encode_chat(prompt + reply)` up to the reply's end-of-turn token (<|eot_id|>,
ChatML's <|im_end|>), the token the reward is read at. A side longer than seq_len has its prompt cut from the LEFT (too_long: truncate;
<|begin_of_text|> stays first, the reply and its <|eot_id|> stay whole; both sides keep the same prompt tokens
so they differ only in the reply), or the pair is dropped (too_long: drop, or the reply alone does not fit).

Batches (B pairs, T = the longest side rounded up to a multiple of 8, or seq_len with pad_to_seq_len):
    input_ids     (2B, T) long   rows [chosen_0 .. chosen_{B-1}, rejected_0 .. rejected_{B-1}], right-padded
    document_ids  (2B, T) long   0 on real tokens, 1 on padding: padding is a document of its own, so no real
                                 token ever attends to it and a side's scores do not depend on it
    score_index   (2B,)   long   position of each side's last real token (its <|eot_id|>)
    pair_mask     (B,)    bool   False on the empty slots that even out validation batches across ranks
    step_pairs    ()      float  pairs in the whole optimizer step (all ranks, all accumulation micro-batches)
Training micro-batches come from SFTBatchPlan over pairs (one "row" = one pair), so the
step layout, resumption and step totals are the SFT stage's.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from data.preference.config import PreferenceDataConfig
from data.preference.records import Messages, PreferenceChat, load_chats
from data.pretrain.sources import require_inputs
from data.records.chat import hold_out
from data.sft.rows import encode_chats
from data.tokenizer.tokenizer import Tokenizer
from models.errors import DataError

PAD_MULTIPLE = 8  # batches are padded to a multiple of this: fewer distinct shapes, friendlier kernels


# -----------------------------------------------------------------------------
# filtering


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
        reply_masks: tuple[list[np.ndarray], list[np.ndarray]] | None = None,
    ):
        self.chosen, self.rejected, self.where = chosen, rejected, where
        # per side, True on the reply's assistant tokens (content + end-of-turn): DPO's response tokens
        self.reply_masks = reply_masks or (
            [np.zeros(len(c), bool) for c in chosen],
            [np.zeros(len(r), bool) for r in rejected],
        )
        self.seq_len, self.pad_id, self.pad_to_seq_len = seq_len, pad_id, pad_to_seq_len
        self.row_tokens = np.array([len(c) + len(r) for c, r in zip(chosen, rejected)], dtype=np.int64)
        self.row_examples = np.ones(len(chosen), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.chosen)

    def subset(self, indices: Sequence[int]) -> PreferencePairs:
        chosen, rejected, where, chosen_masks, rejected_masks = (
            [items[i] for i in indices] for items in (self.chosen, self.rejected, self.where, *self.reply_masks)
        )
        return PreferencePairs(
            chosen, rejected, where, self.seq_len, self.pad_id, self.pad_to_seq_len, (chosen_masks, rejected_masks)
        )

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
    """Each side as encode_chat(prompt + reply) up to the reply's last end-of-turn token, fitted to seq_len;
    returns (pairs, counts)."""
    # Whatever the chat template, the prompt's own encoding is a prefix of each side's (a template that renders a
    # conversation otherwise is refused by encode_chat), so a side is the prompt's ids followed by its reply's.
    conversations = [turns for c in chats for turns in (c.prompt, [*c.prompt, *c.chosen], [*c.prompt, *c.rejected])]
    encoded = encode_chats(tokenizer, conversations, config.num_proc)
    chosen, rejected, masks, where = [], [], ([], []), []
    counts = {"truncated": 0, "dropped_too_long": 0}
    for k, chat in enumerate(chats):
        (prompt, _), *sides = encoded[3 * k : 3 * k + 3]
        replies = [_reply(prompt, ids, mask, chat.where) for ids, mask in sides]
        longest = max(len(ids) for ids, _ in replies)
        prompt, truncated = fit_prompt(prompt, longest, config.seq_len, config.too_long)
        if prompt is None:
            counts["dropped_too_long"] += 1
            continue
        counts["truncated"] += truncated
        for (ids, mask), out, out_mask in zip(replies, (chosen, rejected), masks):
            out.append(np.asarray(prompt + ids, dtype=np.int64))
            out_mask.append(np.asarray([False] * len(prompt) + mask, dtype=bool))
        where.append(chat.where)
    pairs = PreferencePairs(
        chosen, rejected, where, config.seq_len, tokenizer.pad_id, config.pad_to_seq_len, reply_masks=masks
    )
    return pairs, counts


def _reply(prompt: list[int], ids: list[int], mask: list[bool], where: str) -> tuple[list[int], list[bool]]:
    """A side's ids and assistant mask after the prompt, ending at its last assistant token (the end-of-turn token
    the reward is read at, not what a template writes after it, such as ChatML's newline)."""
    if ids[: len(prompt)] != prompt:
        raise DataError(f"{where}: the chat template does not encode the prompt as a prefix of prompt + reply")
    end = max((i + 1 for i, m in enumerate(mask) if m), default=len(ids))
    return ids[len(prompt) : end], mask[len(prompt) : end]


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


def stage_logger(stage: str) -> logging.Logger:
    """The logger of the stage training on the pairs ("RM" -> lantern.rm, "DPO" -> lantern.dpo)."""
    return logging.getLogger(f"lantern.{stage.lower()}")


def build_preference_data(
    config: PreferenceDataConfig, tokenizer: Tokenizer | None = None, stage: str = "RM"
) -> PreferenceData:
    """Load, convert, filter and encode the train and val pairs (see the module docstring); skipped rows are
    warned about under `stage`'s logger (the pairs serve the reward model and DPO)."""
    require_inputs(config.train, "preference data config", "train")
    tokenizer = tokenizer or Tokenizer.load(config.tokenizer)
    chats, train_load = load_chats(config, config.train, "train", stage_logger(stage))
    train, train_stats = _prepare(chats, tokenizer, config)
    stats: dict[str, Any] = {"seq_len": config.seq_len, "train": {**train_load, **train_stats}}
    if config.val:
        val_chats, val_load = load_chats(config, config.val, "val", stage_logger(stage))
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


def log_summary(stats: dict[str, Any], stage: str = "RM") -> None:
    """One line per split, named after the stage that trains on the pairs (RM or DPO), under its logger."""
    logger = stage_logger(stage)
    for name in ("train", "val"):
        s = stats.get(name)
        if not s:
            continue
        if "rows_read" not in s:
            logger.info("%s %s: %d pairs held out from train", stage, name, s["pairs"])
            continue
        logger.info(
            "%s %s: %d rows read, skipped %s; dropped %d with an empty reply, %d with identical replies, %d too long; "
            "%d prompts truncated; %d pairs (%.1f tokens per side on average, seq_len %d)",
            stage,
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
