"""
LightningDataModule for pretraining on prepared token shards.

The datamodule shards the data itself: build the Trainer with `use_distributed_sampler=False`, or
Lightning would replace the StreamSampler with a DistributedSampler and lose the resumable stream.

The training loop must report what it trained on: call `datamodule.mark_consumed()` once per
micro-batch, inside training_step (before any checkpoint of that step is written), so the
checkpointed position is exactly the next unseen sample. That bookkeeping (rank, world size, stream
position, checkpoint state) is StreamDataModule's, shared with the other datamodules.

A mixture (``sources``: name -> weight) reads each source from ``data_dir/NAME``: training draws windows by weight
through one MixtureSampler over the sources' windows concatenated, and validation has one loader per source (in
``source_names`` order: Lightning's ``dataloader_idx``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, ConcatDataset, DataLoader, Sampler

from data.pretrain.manifest import data_fingerprint
from data.streams.datamodule import PackedDataset, StreamDataModule, StreamLoader, StreamSampler
from data.streams.mixture import MixtureSampler
from data.streams.shards import read_manifest
from models.errors import DataError
from models.files.atomic import close_lock
from models.files.folders import hold_for_reading

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
        sources: Mapping[str, float] | None = None,
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
        self.sources = dict(sources or {})  # a mixture's weights by source name; {}: data_dir is one corpus
        self.train_dataset: PackedDataset | ConcatDataset | None = None
        self.train_parts: dict[str, PackedDataset] = {}  # a mixture's training windows per source
        self.val_datasets: dict[str, PackedDataset] | None = None  # by source name ("" for one corpus)
        self.prepared: dict[str, dict] = {}  # by source name: the prepared data's fingerprint and inputs (setup)
        self._reading: dict[Path, int | None] = {}  # folder -> its readers-file lock, held from setup to teardown

    @property
    def source_names(self) -> list[str]:
        """A mixture's sources in config order (its validation loaders' order); [] for one corpus."""
        return list(self.sources)

    @property
    def val_dataset(self) -> PackedDataset | None:
        """The validation windows of one corpus (a mixture's are in ``val_datasets``)."""
        return (self.val_datasets or {}).get("")

    def _folders(self) -> dict[str, Path]:
        if not self.sources:
            return {"": Path(self.data_dir)}
        return {name: Path(self.data_dir) / name for name in self.sources}

    def state_dict(self) -> dict:
        state = super().state_dict()
        return {**state, "prepared": self.prepared} if state else state

    def load_state_dict(self, state_dict: dict) -> None:
        """A checkpoint resumes only on the data it trained on: the stream position means nothing in other data,
        even of the same size (a corpus edited and prepared again). Checkpoints written before fingerprints were
        recorded carry none and are not checked."""
        saved = state_dict.get("prepared") or {}
        for name, was in saved.items():
            now = self.prepared.get(name)
            if now is not None and now["fingerprint"] != was["fingerprint"]:
                raise DataError(
                    f"the checkpoint trained on other prepared data than {self._where(name)} now holds (fingerprint "
                    f"{was['fingerprint']}, prepared from {', '.join(was['inputs'][:3]) or 'a hub dataset'}; now "
                    f"{now['fingerprint']}, from {', '.join(now['inputs'][:3]) or 'a hub dataset'}): its position in "
                    "the stream means nothing there. Prepare the data it trained on again, or start a new run "
                    "(run.name, or checkpoint.resume=none)"
                )
        super().load_state_dict(state_dict)

    def _where(self, name: str) -> str:
        return f"source {name!r} ({Path(self.data_dir) / name})" if name else self.data_dir

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens in one micro-batch on one rank (multiply by world_size for the global count)."""
        return self.micro_batch_size * self.seq_len

    # --- setup -----------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        folders = self._folders()
        for folder in folders.values():  # no `lantern prepare` rebuilds them while this run reads them
            if folder not in self._reading and folder.is_dir():
                self._reading[folder] = hold_for_reading(folder, what="data folder")
        manifests = {
            name: self._read(name, lambda folder=folder: read_manifest(folder)) for name, folder in folders.items()
        }
        # what this run reads, by content: recorded with the run and in each checkpoint, and checked on resume
        self.prepared = {
            name: {"fingerprint": data_fingerprint(m), "inputs": [i.get("path") for i in m.get("inputs", [])]}
            for name, m in manifests.items()
        }
        if stage in (None, "fit") and self.train_dataset is None:
            self.train_parts = {name: self._dataset(name, "train") for name in folders}
            parts = list(self.train_parts.values())
            self.train_dataset = ConcatDataset(parts) if self.sources else parts[0]
            self._check_train_size()
        if stage in (None, "fit", "validate") and self.val_datasets is None:
            with_val = [name for name, manifest in manifests.items() if manifest["splits"].get("val", {}).get("tokens")]
            for name in folders:
                if name not in with_val:
                    log.info("no validation split in %s (val_fraction was 0): no validation of it", self._where(name))
            self.val_datasets = {name: self._dataset(name, "val") for name in with_val}  # too short: ValueError

    def teardown(self, stage: str | None = None) -> None:
        """The data folders are free for a rebuild again."""
        for fd in self._reading.values():
            if fd is not None:
                close_lock(fd)
        self._reading.clear()

    def on_exception(self, exception: BaseException) -> None:  # a run that fails gets no teardown from Lightning
        self.teardown()

    def _read(self, name: str, read: Any) -> Any:
        """``read()``, with a mixture's ValueError naming the source it is about."""
        try:
            return read()
        except ValueError as error:
            if not name:
                raise
            raise ValueError(f"data source {name!r}: {error}") from None

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

    def _dataset(self, name: str, split: str) -> PackedDataset:
        folder = self._folders()[name]
        return self._read(
            name, lambda: PackedDataset(folder / split, self.seq_len, document_masking=self.document_masking)
        )

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
        if self.sources:
            sizes = {name: len(part) for name, part in self.train_parts.items()}
            sampler = MixtureSampler(
                sizes, self.sources, rank=self.rank, world_size=self.world_size, shuffle=True, seed=self.seed
            )
        else:
            sampler = StreamSampler(
                len(self.train_dataset), rank=self.rank, world_size=self.world_size, shuffle=True, seed=self.seed
            )
        batches = BatchSampler(self._attach_sampler(sampler), self.micro_batch_size, drop_last=True)
        if self.sources and self.rank == 0:
            self._log_mixture(sampler)
        return self._loader(self.train_dataset, StreamLoader, batch_sampler=batches)

    def _log_mixture(self, sampler: MixtureSampler) -> None:
        """One line: each source's share, windows and the passes over it the run makes (a small source repeats)."""
        trainer = getattr(self, "trainer", None)
        max_steps = getattr(trainer, "max_steps", -1) if trainer is not None else -1
        accumulate = getattr(trainer, "accumulate_grad_batches", 1) if trainer is not None else 1
        total = max_steps * accumulate * self.micro_batch_size * self.world_size if max_steps > 0 else None
        epochs = sampler.epochs(total) if total is not None and total >= sampler.phase_start else {}
        parts = []
        for name, size in zip(sampler.names, sampler.sizes.tolist()):
            part = f"{name} {sampler.weights[name]:.1%} of {size:,} windows"
            if name in epochs:
                part += f", {epochs[name]:.2f} epochs by step {max_steps:,}" + (
                    " (repeats)" if epochs[name] > 1 else ""
                )
            parts.append(part)
        log.info("data mixture: %s", "; ".join(parts))

    def _log_resumed(self, sampler: Any) -> None:
        note = getattr(sampler, "resume_note", None)  # a mixture resumed with other weights: said in one line
        if not note:
            super()._log_resumed(sampler)
        elif self.rank == 0:
            trainer = getattr(self, "trainer", None)
            step = f"step {trainer.global_step:,}" if trainer is not None else "the checkpoint's step"
            log.info("%s; continuing at %s (%s samples in)", note, step, f"{sampler.consumed:,}")

    def val_dataloader(self) -> DataLoader | list:
        if self.val_datasets is None:
            self.setup("validate")
        loaders = [self._val_loader(name, dataset) for name, dataset in self.val_datasets.items()]
        if not self.sources:
            return loaders[0] if loaders else []  # Lightning skips validation for an empty list
        if loaders and len(loaders) != len(self.sources):  # dataloader_idx must be the source's index
            missing = [name for name in self.sources if name not in self.val_datasets]
            raise ValueError(
                f"data sources {', '.join(missing)} have no validation split while the others do; "
                "prepare them again with val_fraction > 0"
            )
        return loaders

    def _val_loader(self, name: str, dataset: PackedDataset) -> DataLoader:
        world, batch = self.world_size, self.micro_batch_size
        total = len(dataset)
        if self.val_batches is not None:
            total = min(total, self.val_batches * batch * world)
        # Every rank must run the same number of batches (collectives would hang otherwise): full
        # global batches when there is at least one, else an equal share per rank.
        total = total // (batch * world) * (batch * world) if total >= batch * world else total // world * world
        if total == 0:
            raise ValueError(
                f"val split in {self._where(name)} has {len(dataset)} sequences, fewer than the {world} ranks; "
                "lower seq_len or prepare with a larger val_fraction"
            )
        sampler = _ShardedRange(total, self.rank, world)
        return self._loader(dataset, sampler=sampler, batch_size=batch, shuffle=False, drop_last=False)
