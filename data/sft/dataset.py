"""
Supervised fine-tuning data: chat records -> encoded examples -> fixed-length rows -> an exact batch plan.

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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from data.records.chat import hold_out, load_conversations
from data.sft.config import SFTDataConfig, normalize_config
from data.sft.examples import Example, encode_examples, fit_to_length, upsample_short
from data.sft.rows import SFTRows, make_rows
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
    config = normalize_config(config)
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
