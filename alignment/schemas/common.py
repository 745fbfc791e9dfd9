"""Sections every fine-tuning stage's config shares: where its initial model comes from, its loader, its held-out answers."""

from __future__ import annotations

from dataclasses import dataclass

from models.config_checks import bounded
from trainer.config import HarnessEvalConfig


@dataclass
class InitConfig:
    # a native / Hugging Face / Meta folder, a .gguf file or a training checkpoint; None: a seeded random `model`
    checkpoint: str | None = None


@dataclass
class StageLoaderConfig:
    micro_batch_size: int = bounded(8, ge=1)
    num_workers: int = bounded(0, ge=0)


@dataclass
class EvalConfig(HarnessEvalConfig):
    generations: int = bounded(64, ge=0)  # validation examples answered greedily each validation (exact match)
    max_new_tokens_margin: int = bounded(8, ge=0)  # each answer may run this many tokens past its reference's length
    batch_size: int = bounded(16, ge=1)
    table_rows: int = bounded(16, ge=0)  # answers logged as a W&B table and to val_samples.jsonl
