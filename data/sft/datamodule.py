"""
LightningDataModule for supervised fine-tuning (data/sft/dataset.py builds the rows, data/sft/batches.py plans the batches).

Like PretrainDataModule, the datamodule shards the data itself: build the Trainer with
`use_distributed_sampler=False` (Lightning would otherwise wrap the plan in a DistributedSampler), and call
`mark_consumed()` once per micro-batch (trainer.callbacks.DataProgress does) so checkpoints resume exactly.

Training batches (B = micro_batch_size, T = seq_len):
    input_ids (B, T) long, targets (B, T) long (-100 = not trained on), document_ids (B, T) long,
    step_tokens () float, step_examples () float   -- over all rows of the optimizer step, all ranks
Validation batches add example_kinds (B, T) long: 0 short-answer example, 1 long, -1 padding; their step
totals cover the same batch index on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from data.sft.batches import SFTBatchPlan, SFTTrainBatches, SFTValBatches
from data.sft.config import normalize_config
from data.sft.dataset import SFTData, build_sft_data, log_summary
from data.streams.datamodule import StreamDataModule, StreamLoader
from data.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("lantern.sft")


class PlanDataModule(StreamDataModule):
    """What SFTDataModule and PreferenceDataModule share: the data is built once, both splits together (the val
    hold-out needs the train rows), and trained on through an SFTBatchPlan of whole micro-batches (`row_batches`
    turns the plan's items into batches). The stream bookkeeping (rank, world size, mark_consumed, checkpoint
    state) is StreamDataModule's. Subclasses name their batches (`row_batches`), their config checker
    (`normalize_config`) and how both splits are built (`build_data`)."""

    row_batches: type[Dataset]  # SFTTrainBatches / PreferenceTrainBatches over data.train
    # the data config's checker (data/sft/config.py, data/preference/config.py): a dataclass or mapping in, checked out
    normalize_config: Callable[[Any], Any]

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
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
        if val_micro_batch_size is not None and val_micro_batch_size < 1:
            raise ValueError(f"val_micro_batch_size must be >= 1 or None, got {val_micro_batch_size}")
        self.config = self.normalize_config(config)
        self.seq_len = self.config.seq_len
        self.micro_batch_size = micro_batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.num_workers = num_workers
        self.val_micro_batch_size = val_micro_batch_size or micro_batch_size
        self.data: Any = None
        self.tokenizer: Tokenizer | None = None

    # --- setup -----------------------------------------------------------------

    def build_data(self, tokenizer: Tokenizer) -> Any:
        """Both splits and their stats (data/sft/dataset.py's SFTData, data/preference/pairs.py's PreferenceData)."""
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
        """Loading and encoding numbers per split (see data/sft/dataset.py build_sft_data, data/preference/pairs.py
        build_preference_data)."""
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
        plan = SFTBatchPlan(
            data.train,
            micro_batch_size=self.micro_batch_size,
            accumulate=self.accumulate_grad_batches,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.config.seed,
            shuffle=True,
        )
        return self._loader(self.row_batches(data.train), StreamLoader, sampler=self._attach_sampler(plan))


class SFTDataModule(PlanDataModule):
    """``config``: an SFTDataConfig or a mapping of its fields."""

    row_batches = SFTTrainBatches
    normalize_config = staticmethod(normalize_config)
    _val_examples: list[dict[str, Any]] | None = None  # built on first use

    def build_data(self, tokenizer: Tokenizer) -> SFTData:
        """Load, encode, upsample and lay out both splits; logs their summary."""
        data = build_sft_data(self.config, tokenizer)
        log_summary(data.stats)
        return data

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens in one micro-batch on one rank, padding included (multiply by world_size for the global count)."""
        return self.micro_batch_size * self.seq_len

    @property
    def supervised_tokens_per_row(self) -> float:
        """Average supervised targets per train row, for throughput reports (tokens_per_micro_batch counts all)."""
        return float(self._require_data().stats["train"]["supervised_tokens_per_row"])

    # --- validation ------------------------------------------------------------

    def val_batches(self, rank: int | None = None, world_size: int | None = None) -> SFTValBatches | None:
        """The validation micro-batches of one rank (default: this one); None without validation rows."""
        data = self._require_data()
        if data.val is None or len(data.val) == 0:
            return None
        rank = self.rank if rank is None else rank
        world_size = self.world_size if world_size is None else world_size
        return SFTValBatches(data.val, self.val_micro_batch_size, rank=rank, world_size=world_size)

    def val_dataloader(self) -> DataLoader | list:
        batches = self.val_batches()
        if batches is None:
            log.info("no SFT validation examples (val_fraction 0 and no val files): validation disabled")
            return []  # Lightning skips validation for an empty list
        return self._loader(batches, shuffle=False)

    # --- validation examples for generation ------------------------------------

    @property
    def val_examples(self) -> list[dict[str, Any]]:
        """Validation examples in load order: prompt_ids (the chat before the last assistant turn, with an open
        assistant header), reference (the last assistant content), kind ("short" / "long"), answer_tokens,
        messages, record (the row as loaded) and where (file and row)."""
        if self._val_examples is None:
            data = self._require_data()
            self._val_examples = [
                {
                    "prompt_ids": self.tokenizer.encode_chat_prompt(e.conversation.messages[:-1]),
                    "reference": e.conversation.messages[-1]["content"],
                    "kind": e.kind,
                    "answer_tokens": e.answer_tokens,
                    "messages": e.conversation.messages,
                    "record": e.conversation.record,
                    "where": e.conversation.where,
                }
                for e in data.val_examples
            ]
        return self._val_examples
