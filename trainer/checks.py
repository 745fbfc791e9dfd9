"""Checks run before any compute, where two independently configured pieces meet."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from models.model import ModelConfig
from trainer.errors import ConfigError


class HasVocab(Protocol):
    vocab_size: int


def check_tokenizer_fits_model(tokenizer: HasVocab, config: ModelConfig, *, model_name: str = "the model") -> None:
    """A tokenizer may be smaller than the embedding table (padded vocabularies are common), never larger:
    its top ids would index past the embeddings."""
    if tokenizer.vocab_size > config.vocab_size:
        source = getattr(tokenizer, "path", "the tokenizer")
        raise ValueError(
            f"tokenizer {source} has {tokenizer.vocab_size} tokens but {model_name} has vocab_size "
            f"{config.vocab_size}: use a matching tokenizer or set model.vocab_size >= {tokenizer.vocab_size}"
        )


def check_same_tokenizer(tokenizer, checkpoint_dir: str | Path, *, key: str) -> None:
    """A checkpoint folder that carries its tokenizer must be used with that tokenizer: a different one of the
    same size would silently map every id to another token."""
    from data.tokenizer import Tokenizer

    for candidate in (Path(checkpoint_dir) / "tokenizer.model", Path(checkpoint_dir) / "original" / "tokenizer.model"):
        if candidate.is_file():
            saved = Tokenizer.from_file(candidate)
            if saved.fingerprint != tokenizer.fingerprint:
                raise ValueError(
                    f"{checkpoint_dir} was trained with the tokenizer in {candidate}, but {key} is {tokenizer.path}: "
                    f"set {key}={candidate}"
                )
            return


def check_initial_model(config: Any, tokenizer: HasVocab, model: ModelConfig) -> None:
    """A stage that starts from ``init.checkpoint`` (or a seeded ``model``) and reads ``data.seq_len`` tokens
    (SFT, reward model): the tokenizer fits the model and is the one the checkpoint carries, and the sequences
    fit its max_seq_len."""
    source = config.init.checkpoint or "the model (model.vocab_size)"
    check_tokenizer_fits_model(tokenizer, model, model_name=source)
    if config.init.checkpoint:
        check_same_tokenizer(tokenizer, config.init.checkpoint, key="data.tokenizer")
    if config.data.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len ({config.data.seq_len}) exceeds the model's max_seq_len ({model.max_seq_len})")
