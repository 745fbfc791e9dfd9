"""The stream bookkeeping every Lantern datamodule shares (pretraining, SFT, preference pairs, PPO prompts), and the
base of the datamodules that build their data once and train through a batch plan (``PlanDataModule``: SFT,
preference).

Each datamodule shards its data itself: the training sampler is ONE global, seeded stream that every rank reads
its share of (StreamSampler, or SFTBatchPlan over it). Build the Trainer with
`use_distributed_sampler=False` (Lightning would otherwise wrap the sampler in a DistributedSampler and lose the
resumable stream), and call `mark_consumed()` once per micro-batch, inside training_step (trainer.callbacks.
DataProgress does), before any checkpoint of that step is written, so the checkpointed position is exactly the
next unseen sample.

The train DataLoader is a StreamLoader: resumable in Lightning's own sense, so a resume in the middle of an epoch
is exact and Lightning, seeing that, does not warn that the loader is not resumable; the datamodule says once that
the position was resumed."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from data.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("lantern.data")


class StreamLoader(DataLoader):
    """The train DataLoader over a StreamDataModule's sampler (as ``sampler``, or inside a BatchSampler as
    ``batch_sampler``), with the ``state_dict`` / ``load_state_dict`` that Lightning's loops look for
    (``lightning.pytorch.utilities.types._Stateful``): its state is the stream position, which the datamodule's
    own state holds too, so Lightning's copy restores what the datamodule already did."""

    @property
    def stream(self) -> Any:
        batches = self.batch_sampler
        return batches.sampler if isinstance(batches, BatchSampler) else self.sampler

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["consumed"]) != self.stream.consumed:  # else the datamodule restored it already
            self.stream.load_state_dict(state)


class StreamDataModule(L.LightningDataModule):
    """Rank and world size from the attached trainer, the stream position (mark_consumed / consumed_samples) and
    the checkpoint state, kept pending until train_dataloader() builds the sampler.

    Subclasses set `seq_len` and `micro_batch_size` and hand the sampler they build in train_dataloader() to
    `_attach_sampler`. The sampler needs advance(), consumed, state_dict() and load_state_dict().
    The state is saved in Lightning checkpoints under the subclass's name."""

    seq_len: int
    micro_batch_size: int

    def __init__(self) -> None:
        super().__init__()
        self.train_sampler: Any = None
        # Sampler state restored before the sampler exists (Lightning restores checkpoints after
        # setup() but before train_dataloader()); applied when the sampler is built.
        self._pending_state: dict | None = None

    # --- distributed ---------------------------------------------------------

    @property
    def rank(self) -> int:
        trainer = getattr(self, "trainer", None)
        return int(trainer.global_rank) if trainer is not None else 0

    @property
    def world_size(self) -> int:
        trainer = getattr(self, "trainer", None)
        return int(trainer.world_size) if trainer is not None else 1

    # --- stream position -------------------------------------------------------

    def _attach_sampler(self, sampler: Any) -> Any:
        """Make `sampler` the training stream, at the position of the one it replaces or of a restored checkpoint."""
        if self.train_sampler is not None:  # rebuilt (e.g. reload_dataloaders_every_n_epochs): keep the position
            sampler.load_state_dict(self.train_sampler.state_dict())
        if self._pending_state is not None:
            sampler.load_state_dict(self._pending_state)
            self._pending_state = None
            self._log_resumed(sampler)
        self.train_sampler = sampler
        return sampler

    def mark_consumed(self, micro_batches: int = 1) -> None:
        """Report that every rank trained on `micro_batches` more micro-batches."""
        if self.train_sampler is None:
            raise RuntimeError("mark_consumed() before train_dataloader(): there is no stream to advance")
        self.train_sampler.advance(micro_batches * self.micro_batch_size * self.world_size)

    @property
    def consumed_samples(self) -> int:
        """Global samples trained on so far (summed over ranks)."""
        if self.train_sampler is not None:
            return self.train_sampler.consumed
        return int(self._pending_state["consumed"]) if self._pending_state else 0

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints under this class's name."""
        if self.train_sampler is not None:
            sampler_state = self.train_sampler.state_dict()
        elif self._pending_state is not None:
            sampler_state = dict(self._pending_state)
        else:
            return {}  # nothing trained yet; Lightning stores nothing for an empty dict
        return {"sampler": sampler_state, "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "sampler" not in state_dict:
            return
        if state_dict.get("seq_len", self.seq_len) != self.seq_len:
            raise ValueError(
                f"checkpoint data stream was built with seq_len {state_dict['seq_len']}, now {self.seq_len}: "
                "the stream position cannot be carried over"
            )
        if self.train_sampler is not None:
            self.train_sampler.load_state_dict(state_dict["sampler"])
            self._log_resumed(self.train_sampler)
        else:
            self._pending_state = dict(state_dict["sampler"])

    def _log_resumed(self, sampler: Any) -> None:
        if self.rank == 0:
            log.info(
                "data: resumed exactly where the checkpoint left the training stream, %s samples in",
                f"{sampler.consumed:,}",
            )


class PlanDataModule(StreamDataModule):
    """A StreamDataModule whose data is built once, both splits together (the val hold-out needs the train rows), and
    trained on through a plan of whole micro-batches. Subclasses name the plan (`batch_plan`), the batches its items
    become (`row_batches`) and how both splits are built (`build_data`); sizes and the config arrive checked at load."""

    batch_plan: type[Sampler]  # SFTBatchPlan: rows to micro-batches, in the stream's resumable order
    row_batches: type[Dataset]  # SFTTrainBatches / PreferenceTrainBatches over data.train

    def __init__(
        self,
        config: Any,
        *,
        micro_batch_size: int,
        accumulate_grad_batches: int = 1,
        num_workers: int = 0,
        val_micro_batch_size: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.seq_len = self.config.seq_len
        self.micro_batch_size = micro_batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.num_workers = num_workers
        self.val_micro_batch_size = val_micro_batch_size or micro_batch_size
        self.data: Any = None
        self.tokenizer: Tokenizer | None = None

    # --- setup -----------------------------------------------------------------

    def build_data(self, tokenizer: Tokenizer) -> Any:
        """Both splits and their stats (SFTData, PreferenceData)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """Load and encode both splits (once; the val hold-out needs the train rows)."""
        if self.data is not None:
            return
        self.tokenizer = Tokenizer.load(self.config.tokenizer)
        self.data = self.build_data(self.tokenizer)

    def _require_data(self) -> Any:
        if self.data is None:
            self.setup("fit")
        return self.data

    @property
    def stats(self) -> dict[str, Any]:
        """Loading and encoding numbers per split."""
        return self._require_data().stats

    # --- loaders ---------------------------------------------------------------

    def _loader(self, dataset, loader_class: type[DataLoader] = DataLoader, **kwargs: Any) -> DataLoader:
        return loader_class(
            dataset,
            batch_size=None,  # the datasets return whole micro-batches
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        data = self._require_data()
        plan = self.batch_plan(
            data.train,
            micro_batch_size=self.micro_batch_size,
            accumulate=self.accumulate_grad_batches,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.config.seed,
            shuffle=True,
        )
        return self._loader(self.row_batches(data.train), StreamLoader, sampler=self._attach_sampler(plan))
