"""
LightningDataModule for reward-model training. It shards the data itself, as SFTDataModule does; micro-batches follow
SFTBatchPlan with one pair per "row": step s takes the pairs at stream positions [s*G, (s+1)*G),
G = world_size * accumulate * micro_batch_size, and `step_pairs` = G.
"""

from __future__ import annotations

from torch.utils.data import DataLoader

from data.preference.pairs import (
    PreferenceData,
    PreferenceEvalBatches,
    PreferenceTrainBatches,
    build_preference_data,
    log_summary,
    stage_logger,
)
from data.sft.batches import SFTBatchPlan
from data.streams.datamodule import PlanDataModule
from data.tokenizer.tokenizer import Tokenizer


class PreferenceDataModule(PlanDataModule):
    """``config``: a PreferenceDataConfig or a mapping of its fields."""

    row_batches = PreferenceTrainBatches
    batch_plan = SFTBatchPlan
    stage = "RM"  # the stage the data's log lines are named after (DPO's subclass says DPO)

    def build_data(self, tokenizer: Tokenizer) -> PreferenceData:
        """Load, convert, filter and encode both splits; logs their summary under the stage's name."""
        data = build_preference_data(self.config, tokenizer, stage=self.stage)
        log_summary(data.stats, self.stage)
        return data

    @property
    def tokens_per_micro_batch(self) -> int:
        """Real tokens in one micro-batch on one rank, on average (both sides of each pair), for throughput."""
        return round(2 * self.micro_batch_size * self._require_data().stats["train"]["mean_side_tokens"])

    def check_step_fits(self, world_size: int) -> None:
        """A clear error when the train pairs cannot fill one optimizer step (callable before launching)."""
        need = world_size * self.accumulate_grad_batches * self.micro_batch_size
        have = len(self._require_data().train)
        if have < need:
            raise ValueError(
                f"{have} train pairs are fewer than one optimizer step needs ({world_size} ranks x "
                f"{self.accumulate_grad_batches} accumulation x {self.micro_batch_size} micro-batch = {need}); add "
                "data or lower loader.micro_batch_size / trainer.accumulate_grad_batches"
            )

    def train_dataloader(self) -> DataLoader:
        self.check_step_fits(self.world_size)
        return super().train_dataloader()

    def eval_batches(self, split: str = "val", limit: int | None = None) -> PreferenceEvalBatches | None:
        """This rank's share of the first `limit` pairs of a split (all of them with None), in equal numbers
        of micro-batches on every rank; None when the split has no pairs."""
        data = self._require_data()
        pairs = data.val if split == "val" else data.train
        if pairs is None or len(pairs) == 0:
            return None
        if limit is not None and limit < len(pairs):
            pairs = pairs.subset(range(limit))
        return PreferenceEvalBatches(pairs, self.val_micro_batch_size, rank=self.rank, world_size=self.world_size)

    def val_dataloader(self) -> DataLoader | list:
        batches = self.eval_batches("val")
        if batches is None:
            stage_logger(self.stage).info("no validation pairs (val_fraction 0 and no val files): validation disabled")
            return []  # Lightning skips validation for an empty list
        return self._loader(batches, shuffle=False)
