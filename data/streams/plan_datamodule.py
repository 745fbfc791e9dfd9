"""The base of the datamodules that build their data once and train through a batch plan (SFT, preference)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from data.streams.datamodule import StreamDataModule, StreamLoader
from data.tokenizer.tokenizer import Tokenizer


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
