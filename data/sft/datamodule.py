"""Supervised fine-tuning data: chat records -> encoded examples -> fixed-length rows -> an exact batch plan, and the
LightningDataModule that serves it (``SFTDataModule``).

Pipeline (build_sft_data):

1. load      JSON / JSON lines / Parquet files (globs) or a hub dataset through Hugging Face `datasets`,
             one file at a time so every problem names its file and row.
2. map       each row to chat messages by schema: "messages" (a list of {role, content}), "prompt_response"
             (prompt: a string or a message list; response: the assistant answer) or "alpaca" (instruction
             [+ "\\n\\n" + input] -> user, output -> assistant); an optional system prompt is prepended to
             rows without a system turn. Bad rows raise a ValueError naming file and row, or are skipped and
             counted per reason (on_bad_row=skip). Nothing is repaired silently.
3. encode    with Tokenizer.encode_chat; `supervised` marks the assistant turns' content + <|eot_id|> (or
             everything with train_on_prompt). Too long examples are truncated or dropped, both counted.
4. upsample  (train only) short-answer examples, by a repeat factor or up to a target share of examples.
5. rows      of exactly seq_len tokens: first-fit-decreasing packing of whole examples (packing=True) or one
             example per row; inputs padded with pad_id, targets with -100. document_ids number the
             examples of a row 0, 1, ...; padding gets the next id, so it is a document of its own.
6. plan      a global, seeded stream of rows cut into optimizer steps of world_size * accumulate *
             micro_batch_size rows; every micro-batch carries its step's totals.

``SFTDataModule`` shards the data itself: build the Trainer with
`use_distributed_sampler=False`, and call `mark_consumed()` once per micro-batch (DataProgress does).

Training batches (B = micro_batch_size, T = seq_len):
    input_ids (B, T) long, targets (B, T) long (-100 = not trained on), document_ids (B, T) long,
    step_tokens () float, step_examples () float   -- over all rows of the optimizer step, all ranks
Validation batches add example_kinds (B, T) long: 0 short-answer example, 1 long, -1 padding; their step
totals cover the same batch index on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from data.pretrain.sources import require_inputs
from data.records.chat import hold_out, load_conversations
from data.sft.batches import SFTBatchPlan, SFTTrainBatches, SFTValBatches
from data.sft.rows import Example, SFTDataConfig, SFTRows, encode_examples, fit_to_length, make_rows, upsample_short
from data.streams.datamodule import PlanDataModule
from data.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("lantern.sft")


@dataclass
class SFTData:
    train: SFTRows
    val: SFTRows | None
    train_examples: list[Example]
    val_examples: list[Example]
    stats: dict[str, Any]


def _split_stats(rows: SFTRows, fit_counts: dict[str, int], encoded: int) -> dict[str, Any]:
    return {
        "examples": encoded,
        **fit_counts,
        "examples_kept": rows.num_examples,
        "rows": len(rows),
        "real_tokens": rows.real_tokens,
        "supervised_tokens": rows.supervised_tokens,
        "supervised_tokens_per_row": rows.supervised_tokens / len(rows) if len(rows) else 0.0,
        "packing_efficiency": rows.efficiency,
    }


def build_sft_data(config: SFTDataConfig, tokenizer: Tokenizer | None = None) -> SFTData:
    """Load, map, validate, encode, upsample and lay out the train and val rows (see the module docstring)."""
    require_inputs(config.train, "SFT data config", "train")
    tokenizer = tokenizer or Tokenizer.load(config.tokenizer)

    conversations, train_load = load_conversations(config, config.train, "train")
    if config.val:
        train_conv = conversations
        val_conv, val_load = load_conversations(config, config.val, "val")
    else:
        train_conv, val_conv = hold_out(conversations, config)
        val_load = {"held_out_from_train": len(val_conv)}
    if not train_conv:
        raise ValueError(
            f"no usable train examples in {config.train} ({train_load['rows_read']} rows read, "
            f"skipped {train_load['skipped']})"
        )

    splits: dict[str, Any] = {}
    stats: dict[str, Any] = {"seq_len": config.seq_len, "packing": config.packing}
    for name, convs, load in (("train", train_conv, train_load), ("val", val_conv, val_load)):
        encoded = encode_examples(convs, tokenizer, config)
        kept, fit_counts = fit_to_length(encoded, config.seq_len, config.too_long)
        if name == "train" and not kept:
            raise ValueError(
                f"all {len(encoded)} train examples were dropped ({fit_counts}); raise seq_len or set too_long: truncate"
            )
        copies, upsampling = upsample_short(kept, config) if name == "train" else (None, None)
        rows = make_rows(kept, copies, config.seq_len, tokenizer.pad_id, config.packing) if kept else None
        if rows is not None:
            split_stats = {**load, **_split_stats(rows, fit_counts, len(encoded))}
        else:  # no validation examples (the train split always has some, checked above)
            split_stats = {**load, "examples": len(encoded), **fit_counts, "examples_kept": 0, "rows": 0}
        if upsampling is not None:
            split_stats["upsampling"] = upsampling
        if name == "val":
            split_stats["short"] = sum(e.kind == "short" for e in kept)
        stats[name] = split_stats
        splits[name] = (rows, kept)
    return SFTData(
        train=splits["train"][0],
        val=splits["val"][0],
        train_examples=splits["train"][1],
        val_examples=splits["val"][1],
        stats=stats,
    )


def log_summary(stats: dict[str, Any]) -> None:
    for name in ("train", "val"):
        s = stats.get(name)
        if not s:
            continue
        source = (
            f"{s['rows_read']} rows read"
            if "rows_read" in s
            else f"{s.get('held_out_from_train', 0)} held out from train"
        )
        log.info(
            "SFT %s: %s, skipped %s, %d examples encoded, truncated %d, dropped %d too long + %d without a target; "
            "%d rows of %d tokens (packing=%s, efficiency %.3f), %d supervised tokens (%.1f per row)",
            name,
            source,
            s.get("skipped", {}),
            s["examples"],
            s["truncated"],
            s["dropped_too_long"],
            s["dropped_no_target"],
            s["rows"],
            stats["seq_len"],
            stats["packing"],
            s.get("packing_efficiency", 0.0),
            s.get("supervised_tokens", 0),
            s.get("supervised_tokens_per_row", 0.0),
        )
        if "upsampling" in s:
            u = s["upsampling"]
            log.info(
                "SFT train short-answer upsampling: %d of %d examples short before, %d of %d after",
                u["short_before"],
                u["examples_before"],
                u["short_after"],
                u["examples_after"],
            )


class SFTDataModule(PlanDataModule):
    """Serves ``build_sft_data``'s rows in the exact batch plan, sharded over ranks by this module itself."""

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
