"""DPO's preference data: the reward model's pairs (read as is: the same formats and
filtering) plus which tokens of a side are the response (``answered_masks``), and batches that carry them as
``targets`` (the next token where it is a response token, IGNORE_INDEX elsewhere) with each slot's
``pair_index`` (the row of the precomputed reference table), in ``DPODataModule``.

The response of a side is what the policy would have written: the content and end-of-turn token of the reply's
assistant turns (the chat encoding's mask, whichever tokenizer and template), not their headers, nor the prompt
(which may itself hold assistant turns). Of those, a turn that both replies share whole and that ends before the
sides part is left out: it would cancel out of DPO's difference anyway.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from data.preference.datamodule import PreferenceDataModule
from data.preference.pairs import PreferenceEvalBatches, PreferencePairs, PreferenceTrainBatches
from data.tokenizer.tokenizer import Tokenizer
from models.errors import DataError
from models.loss import IGNORE_INDEX

# ---- which tokens are the response ----


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def answered_masks(
    chosen: np.ndarray, rejected: np.ndarray, reply_masks: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The response tokens of both sides of a pair (see the module docstring), as bool masks over their ids: the
    assistant turns of each reply (``reply_masks``) that end after the first token where the sides differ."""
    shared = min(len(chosen), len(rejected))
    differ = np.flatnonzero(chosen[:shared] != rejected[:shared])
    parted = int(differ[0]) if differ.size else shared
    out = []
    for mask in reply_masks:
        answered = np.zeros(len(mask), dtype=bool)
        for start, end in _runs(mask):
            if end > parted:  # a turn both replies share whole cancels out of DPO's difference
                answered[start:end] = True
        out.append(answered)
    return out[0], out[1]


def attach_answered_masks(pairs: PreferencePairs) -> None:
    """Give ``pairs`` a ``response_masks`` attribute (chosen masks, rejected masks); a side without a response
    token is a DataError naming its row."""
    chosen, rejected = [], []
    for index, (c, r) in enumerate(zip(pairs.chosen, pairs.rejected)):
        masks = (pairs.reply_masks[0][index], pairs.reply_masks[1][index])
        c_mask, r_mask = answered_masks(c, r, masks)
        if not c_mask.any() or not r_mask.any():
            raise DataError(f"{pairs.where[index]}: a reply has no assistant tokens to score")
        chosen.append(c_mask)
        rejected.append(r_mask)
    pairs.response_masks = (chosen, rejected)


# ---- batches with the DPO fields, and the datamodule ----


def with_dpo_fields(batch: dict[str, torch.Tensor], pairs: PreferencePairs, indices: Any) -> dict[str, torch.Tensor]:
    """Add ``targets`` (2B, T) and ``pair_index`` (B,) (-1 on empty slots) to a preference batch."""
    indices = [int(i) for i in indices]
    rows, width = batch["input_ids"].shape
    answered = torch.zeros((rows, width), dtype=torch.bool)
    chosen, rejected = pairs.response_masks
    for row, index in enumerate(indices):
        if index >= 0:
            answered[row, : len(chosen[index])] = torch.from_numpy(chosen[index])
            answered[len(indices) + row, : len(rejected[index])] = torch.from_numpy(rejected[index])
    ids = batch["input_ids"]
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, :-1] = torch.where(answered[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE_INDEX))
    return {**batch, "targets": targets, "pair_index": torch.tensor(indices, dtype=torch.long)}


class DPOTrainBatches(PreferenceTrainBatches):
    def __getitem__(self, item: tuple) -> dict[str, torch.Tensor]:
        return with_dpo_fields(super().__getitem__(item), self.pairs, item[0])


class DPOEvalBatches(PreferenceEvalBatches):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return with_dpo_fields(super().__getitem__(index), self.pairs, self.slots(index, self.rank))


class DPODataModule(PreferenceDataModule):
    """The reward model's preference data with the DPO fields in every batch (train, val, the reference pass)."""

    row_batches = DPOTrainBatches
    stage = "DPO"  # its data statistics and skipped-row warnings are DPO's, not the reward model's

    def build_data(self, tokenizer: Tokenizer) -> Any:
        data = super().build_data(tokenizer)
        for pairs in (data.train, data.val):
            if pairs is not None:
                attach_answered_masks(pairs)
        return data

    def eval_batches(self, split: str = "val", limit: int | None = None) -> DPOEvalBatches | None:
        """This rank's share of every pair of a split (``limit`` is not supported: the masks are per split)."""
        if limit is not None:
            raise ValueError("DPODataModule.eval_batches scores whole splits")
        data = self._require_data()
        pairs = data.val if split == "val" else data.train
        if pairs is None or len(pairs) == 0:
            return None
        return DPOEvalBatches(pairs, self.val_micro_batch_size, rank=self.rank, world_size=self.world_size)
