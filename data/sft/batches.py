"""
SFT batches: the exact, seeded plan of which rows each rank trains on at each step, and the batch datasets.

A global, seeded stream of rows (StreamSampler positions). Optimizer step s takes positions
[s*G, (s+1)*G), G = world_size * accumulate * micro_batch_size; rank r's micro-batch j of that step takes
s*G + (j*world_size + r)*micro_batch_size + [0, micro_batch_size). Every micro-batch carries the step's totals
over all G rows (step_tokens, step_examples), so a loss normalised by them is the same for 1 x 8, 8 x 1 and
2 ranks x 4.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from data.sft.rows import SFTRows
from data.streams.datamodule import StreamSampler

log = logging.getLogger("lantern.sft")


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
