"""
LightningDataModule for pretraining on prepared token shards.

The datamodule shards the data itself: build the Trainer with `use_distributed_sampler=False`, or
Lightning would replace the StreamSampler with a DistributedSampler and lose the resumable stream.

The training loop must report what it trained on: call `datamodule.mark_consumed()` once per
micro-batch, inside training_step (before any checkpoint of that step is written), so the
checkpointed position is exactly the next unseen sample. That bookkeeping (rank, world size, stream
position, checkpoint state) is StreamDataModule's, shared with the other datamodules.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from data.streams.datamodule import StreamDataModule, StreamLoader
from data.streams.packed import PackedDataset, StreamSampler
from data.streams.shards import read_manifest

log = logging.getLogger("lantern.data")


class _ShardedRange(Sampler[int]):
    """Indices rank, rank + W, rank + 2W, ... below `total`: a fixed, unshuffled validation shard."""

    def __init__(self, total: int, rank: int, world_size: int):
        self.total, self.rank, self.world_size = total, rank, world_size

    def __iter__(self):
        return iter(range(self.rank, self.total, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.total, self.world_size))


class PretrainDataModule(StreamDataModule):
    def __init__(
        self,
        data_dir: str,
        seq_len: int,
        micro_batch_size: int,
        *,
        document_masking: bool = True,
        seed: int = 1234,
        num_workers: int = 0,
        val_batches: int | None = None,
    ):
        super().__init__()
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if val_batches is not None and val_batches < 0:
            raise ValueError(f"val_batches must be >= 0 or None, got {val_batches}")
        self.data_dir = str(data_dir)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.document_masking = document_masking
        self.seed = seed
        self.num_workers = num_workers
        self.val_batches = val_batches
        self.train_dataset: PackedDataset | None = None
        self.val_dataset: PackedDataset | None = None

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens in one micro-batch on one rank (multiply by world_size for the global count)."""
        return self.micro_batch_size * self.seq_len

    # --- setup -----------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        read_manifest(self.data_dir)  # a clear error when the data was never prepared
        if stage in (None, "fit") and self.train_dataset is None:
            self.train_dataset = self._dataset("train")
            self._check_train_size()
        if stage in (None, "fit", "validate") and self.val_dataset is None:
            val_info = read_manifest(self.data_dir)["splits"].get("val", {})
            if val_info.get("tokens", 0) == 0:
                log.info("no validation split in %s (val_fraction was 0): validation disabled", self.data_dir)
            else:
                self.val_dataset = self._dataset("val")  # too few tokens -> ValueError naming the split

    def _check_train_size(self) -> None:
        # Checked again when the loader is built: setup() may run before a Trainer (and so the real
        # world size) is attached.
        per_step = self.micro_batch_size * self.world_size
        if len(self.train_dataset) < per_step:
            raise ValueError(
                f"train split in {self.data_dir} has {len(self.train_dataset)} sequences of {self.seq_len} tokens, "
                f"fewer than one global micro-batch ({self.micro_batch_size} x {self.world_size} ranks); "
                "lower seq_len / micro_batch_size or add data"
            )

    def _dataset(self, split: str) -> PackedDataset:
        return PackedDataset(Path(self.data_dir) / split, self.seq_len, document_masking=self.document_masking)

    # --- loaders ---------------------------------------------------------------

    def _loader(self, dataset: PackedDataset, loader_class: type[DataLoader] = DataLoader, **kwargs: Any) -> DataLoader:
        return loader_class(
            dataset,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        self._check_train_size()
        sampler = StreamSampler(
            len(self.train_dataset), rank=self.rank, world_size=self.world_size, shuffle=True, seed=self.seed
        )
        batches = BatchSampler(self._attach_sampler(sampler), self.micro_batch_size, drop_last=True)
        return self._loader(self.train_dataset, StreamLoader, batch_sampler=batches)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []  # Lightning skips validation for an empty list
        world, batch = self.world_size, self.micro_batch_size
        total = len(self.val_dataset)
        if self.val_batches is not None:
            total = min(total, self.val_batches * batch * world)
        # Every rank must run the same number of batches (collectives would hang otherwise): full
        # global batches when there is at least one, else an equal share per rank.
        total = total // (batch * world) * (batch * world) if total >= batch * world else total // world * world
        if total == 0:
            raise ValueError(
                f"val split in {self.data_dir} has {len(self.val_dataset)} sequences, fewer than the {world} ranks; "
                "lower seq_len or prepare with a larger val_fraction"
            )
        sampler = _ShardedRange(total, self.rank, world)
        return self._loader(self.val_dataset, sampler=sampler, batch_size=batch, shuffle=False, drop_last=False)
