"""Checks run before any compute, where two independently configured pieces meet."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from data.tokenizer.base import load_tokenizer, resolve_tokenizer_spec
from data.tokenizer.files import find_tokenizer
from models.errors import ConfigError
from models.model import ModelConfig

log = logging.getLogger(__name__)


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
    same size would silently map every id to another token. A Hugging Face or Meta folder that carries none
    says nothing of its tokenizer, so the bundled default, which could fit its vocabulary all the same, is refused
    there."""
    folder = Path(checkpoint_dir)
    found = find_tokenizer(folder) if folder.is_dir() else None
    if found is not None:
        if Path(tokenizer.path).resolve() == found.resolve():
            return  # read from that very file (data.tokenizer: auto): nothing to compare, nothing to read again
        if load_tokenizer(found).fingerprint != tokenizer.fingerprint:
            raise ConfigError(
                f"{checkpoint_dir} carries its tokenizer ({found}), but {key} is {tokenizer.path}: set {key}={found} "
                "or leave it at auto"
            )
        return
    foreign = any((folder / name).is_file() for name in ("config.json", "params.json", "original/params.json"))
    if foreign and not (folder / "lantern.json").is_file() and tokenizer.fingerprint == load_tokenizer().fingerprint:
        raise ConfigError(
            f"{folder} carries no tokenizer (tokenizer.json, tokenizer.model or original/tokenizer.model): set {key} "
            "to the tokenizer the model was trained with, not the bundled default"
        )


def resolve_stage_tokenizer(config: Any) -> None:
    """``data.tokenizer: auto`` becomes the tokenizer of the checkpoint the stage starts from (``init.checkpoint``
    or ``init.policy``), else the bundled default; config.yaml then records which."""
    data = getattr(config, "data", None)
    if data is None or getattr(data, "tokenizer", None) != "auto":
        return
    init = getattr(config, "init", None)
    start = getattr(init, "checkpoint", None) or getattr(init, "policy", None)
    data.tokenizer = resolve_tokenizer_spec("auto", start)


def check_initial_model(config: Any, tokenizer: HasVocab, model: ModelConfig) -> None:
    """A stage that starts from ``init.checkpoint`` (or a seeded ``model``) and reads ``data.seq_len`` tokens
    (SFT, reward model): the tokenizer fits the model and is the one the checkpoint carries, and the sequences
    fit its max_seq_len. ``config.model`` is set to the model really built, so that config.yaml and the
    checkpoints record it (a preset's ``model: tiny`` is only the fallback when there is no checkpoint)."""
    # Only a model section someone set is worth a warning: a stage preset that names none (the pipeline's, which
    # start from the previous stage's model) carries the schema's default, which nobody asked for.
    if config.init.checkpoint and config.model != model and config.model != ModelConfig():
        log.warning(
            "model section ignored: the model is %s's (dim %d, %d layers, vocab %d), not the configured "
            "(dim %d, %d layers, vocab %d); config.yaml records the checkpoint's",
            config.init.checkpoint,
            model.dim,
            model.n_layers,
            model.vocab_size,
            config.model.dim,
            config.model.n_layers,
            config.model.vocab_size,
        )
    source = config.init.checkpoint or "the model (model.vocab_size)"
    check_tokenizer_fits_model(tokenizer, model, model_name=source)
    if config.init.checkpoint:
        check_same_tokenizer(tokenizer, config.init.checkpoint, key="data.tokenizer")
        config.model = model
    check_context_length({"data.seq_len": config.data.seq_len}, model.max_seq_len, "the model's max_seq_len")


def check_context_length(lengths: dict[str, int], max_seq_len: int, limit: str) -> None:
    """The one context check every stage makes before any compute: the tokens a row can hold (``lengths``, config
    key -> tokens, summed: e.g. a prompt budget plus a response budget) fit the context ``max_seq_len``, named
    ``limit`` in the error (a key such as "model.max_seq_len", or "the policy's max_seq_len")."""
    if sum(lengths.values()) > max_seq_len:
        needed = " + ".join(f"{key} ({tokens})" for key, tokens in lengths.items())
        verb = "exceeds" if len(lengths) == 1 else "exceed"
        raise ConfigError(f"{needed} {verb} {limit} ({max_seq_len})")
