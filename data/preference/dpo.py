"""DPO's preference data: the reward model's pairs (data/preference/pairs.py, read as is: the same formats and
filtering) plus which tokens of a side are the response (``answered_masks``), and batches that carry them as
``targets`` (the next token where it is a response token, IGNORE_INDEX elsewhere) with each slot's
``pair_index`` (the row of the precomputed reference table), in ``DPODataModule``. The DPO stage (its recipe, the
loss, the reference) is alignment/stages/dpo.py and dpo_module.py.

The response of a side is what the policy would have written: the content and <|eot_id|> of the reply's
assistant turns, not their headers, nor the prompt (which may itself hold assistant turns). The reply starts at
the last <|start_header_id|> the two sides share: their prompts are identical token for token
(data/preference/pairs.py cuts both alike) and the replies differ, so that is the first reply turn's header, or,
when the replies share whole turns, the header of the turn where they part (shared turns would cancel out of
DPO's difference anyway). Special tokens cannot come from text, so reading them off the ids is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from data.preference.datamodule import PreferenceDataModule
from data.preference.pairs import PreferenceEvalBatches, PreferencePairs, PreferenceTrainBatches
from data.tokenizer.tokenizer import Tokenizer
from models.errors import DataError
from models.loss import IGNORE_INDEX

# ---- which tokens are the response ----


@dataclass(frozen=True)
class ChatMarkers:
    """The ids that delimit chat turns in ``Tokenizer.encode_chat``'s layout."""

    start_header: int
    end_header: int
    eot: int
    assistant: tuple[int, ...]  # the role's ids between the header tokens
    header_gap: int  # ids of the "\n\n" after <|end_header_id|>

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatMarkers:
        return cls(
            tokenizer.start_header_id,
            tokenizer.end_header_id,
            tokenizer.eot_id,
            tuple(tokenizer.encode("assistant")),
            len(tokenizer.encode("\n\n")),
        )


def _assistant_bodies(side: np.ndarray, start: int, markers: ChatMarkers) -> np.ndarray:
    """True on the content and <|eot_id|> of every assistant turn that begins at or after ``start``."""
    mask = np.zeros(len(side), dtype=bool)
    for header in np.flatnonzero(side[start:] == markers.start_header) + start:
        ends = np.flatnonzero(side[header:] == markers.end_header)
        if not ends.size:
            break
        body = header + int(ends[0]) + 1 + markers.header_gap
        eots = np.flatnonzero(side[body:] == markers.eot)
        stop = body + int(eots[0]) + 1 if eots.size else len(side)
        if tuple(side[header + 1 : header + int(ends[0])].tolist()) == markers.assistant:
            mask[body:stop] = True
    return mask


def answered_masks(chosen: np.ndarray, rejected: np.ndarray, markers: ChatMarkers) -> tuple[np.ndarray, np.ndarray]:
    """The response tokens of both sides of a pair (see the module docstring), as bool masks over their ids."""
    shared = min(len(chosen), len(rejected))
    differ = np.flatnonzero(chosen[:shared] != rejected[:shared])
    shared = int(differ[0]) if differ.size else shared
    headers = np.flatnonzero(chosen[:shared] == markers.start_header)
    reply = int(headers[-1]) if headers.size else 0
    return _assistant_bodies(chosen, reply, markers), _assistant_bodies(rejected, reply, markers)


def attach_answered_masks(pairs: PreferencePairs, markers: ChatMarkers) -> None:
    """Give ``pairs`` a ``response_masks`` attribute (chosen masks, rejected masks); a side without a response
    token is a DataError naming its row."""
    chosen, rejected = [], []
    for index, (c, r) in enumerate(zip(pairs.chosen, pairs.rejected)):
        c_mask, r_mask = answered_masks(c, r, markers)
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
        markers = ChatMarkers.of(tokenizer)
        for pairs in (data.train, data.val):
            if pairs is not None:
                attach_answered_masks(pairs, markers)
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
