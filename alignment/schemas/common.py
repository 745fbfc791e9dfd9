"""Sections every fine-tuning stage's config shares: where its initial model comes from, its loader, its held-out answers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InitConfig:
    checkpoint: str | None = None  # native / Hugging Face / Meta folder; None: a seeded random `model`


@dataclass
class StageLoaderConfig:
    micro_batch_size: int = 8
    num_workers: int = 0


@dataclass
class EvalConfig:
    generations: int = 64  # validation examples answered greedily each validation (exact match)
    max_new_tokens_margin: int = 8  # each answer may run this many tokens past its reference's length
    batch_size: int = 16
    table_rows: int = 16  # answers logged as a W&B table and to val_samples.jsonl
