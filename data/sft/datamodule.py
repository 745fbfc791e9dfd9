"""
LightningDataModule for supervised fine-tuning. It shards the data itself: build the Trainer with
`use_distributed_sampler=False`, and call `mark_consumed()` once per micro-batch (DataProgress does).

Training batches (B = micro_batch_size, T = seq_len):
    input_ids (B, T) long, targets (B, T) long (-100 = not trained on), document_ids (B, T) long,
    step_tokens () float, step_examples () float   -- over all rows of the optimizer step, all ranks
Validation batches add example_kinds (B, T) long: 0 short-answer example, 1 long, -1 padding; their step
totals cover the same batch index on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import DataLoader

from data.sft.batches import SFTBatchPlan, SFTTrainBatches, SFTValBatches
from data.sft.dataset import SFTData, build_sft_data, log_summary
from data.streams.plan_datamodule import PlanDataModule
from data.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("lantern.sft")


class SFTDataModule(PlanDataModule):
    """``config``: an SFTDataConfig or a mapping of its fields."""

    row_batches = SFTTrainBatches
    batch_plan = SFTBatchPlan
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
