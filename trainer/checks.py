"""Checks run before any compute, where two independently configured pieces meet; and what a run resumes, checked
before it does: a checkpoint of this run's model, optimizer and strategy, with steps left to train
(``resolve_resume`` names the checkpoint: ``checkpoint.resume``, auto, none or a path)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from data.tokenizer.base import TokenizerBase, load_tokenizer, resolve_tokenizer_spec
from data.tokenizer.files import find_tokenizer
from models.errors import CheckpointError, ConfigError
from models.files.checksums import sha256_file
from models.formats.checkpoint import TOKENIZER_RECORD
from models.formats.checkpoint_io import architecture_differences
from models.model import ModelConfig
from trainer.checkpoints import checkpoint_step, has_checkpoints, latest_checkpoint, read_checkpoint_header
from trainer.config import CheckpointConfig
from trainer.model_sources import source_kind, source_model_config, source_tokenizer
from trainer.optim_config import check_resumed_optim

log = logging.getLogger(__name__)
resume_log = logging.getLogger("trainer.build")  # where "resuming from" has always been logged


class HasVocab(Protocol):
    vocab_size: int


def check_model_tokenizer(
    spec: str | Path,
    model: ModelConfig,
    checkpoint: str | Path | None = None,
    *,
    key: str = "data.tokenizer",
    vocab_key: str | None = "model.vocab_size",
) -> tuple[str, TokenizerBase]:
    """The one check of a tokenizer against the model it is paired with, before any compute, made by every command
    that pairs them (each stage through ``check_stage_config``, hence the pipeline; ``lantern generate``).

    ``spec`` is resolved ('auto': the tokenizer ``checkpoint`` carries, else the bundled default) and loaded, then
    refused in one line when: 'auto' fell back to the default for a checkpoint that carries no tokenizer and whose
    vocabulary is not the default's; its ids do not fit the model's embeddings (``check_tokenizer_fits_model``); the
    checkpoint carries another tokenizer (``check_same_tokenizer``). ``key`` is how the user names a tokenizer
    (``data.tokenizer``, ``--tokenizer``); ``vocab_key`` how they size the vocabulary of a model built from its
    config (None: they cannot). Returns (the resolved spec, the tokenizer).
    """
    resolved = resolve_tokenizer_spec(spec, checkpoint)
    folder = Path(checkpoint) if checkpoint else None
    if folder is not None and str(spec) == "auto" and resolved == "default" and folder.is_dir():
        default = load_tokenizer("default")
        # a folder that names no tokenizer: the default is only a guess, and a wrong one when the sizes differ
        if default.vocab_size != model.vocab_size:
            raise ConfigError(
                f"{folder} carries no tokenizer (tokenizer.json, tokenizer.model or original/tokenizer.model) and "
                f"its vocab_size ({model.vocab_size}) is not the bundled default tokenizer's ({default.vocab_size}): "
                f"{_naming(key, 'TOKENIZER')}, the tokenizer file (or folder) the model was trained with"
            )
    tokenizer = load_tokenizer(resolved)
    name = str(checkpoint) if checkpoint else f"the model ({vocab_key})" if vocab_key else "the model"
    check_tokenizer_fits_model(tokenizer, model, model_name=name, key=key, vocab_key=None if checkpoint else vocab_key)
    if folder is not None:
        check_same_tokenizer(tokenizer, folder, key=key)
    return resolved, tokenizer


def _naming(key: str, value: str) -> str:
    """How the user gives ``key`` the value: a config key is set, a command's option passed."""
    return f"pass {key} {value}" if key.startswith("--") else f"set {key}={value}"


def check_tokenizer_fits_model(
    tokenizer: HasVocab,
    config: ModelConfig,
    *,
    model_name: str = "the model",
    key: str = "data.tokenizer",
    vocab_key: str | None = "model.vocab_size",
) -> None:
    """A tokenizer may be smaller than the embedding table (padded vocabularies are common), never larger:
    its top ids would index past the embeddings. The error names both sizes, the tokenizer's file and the model,
    and what to change: ``key``, or ``vocab_key`` (None: a checkpoint's vocabulary, which no option resizes)."""
    if tokenizer.vocab_size > config.vocab_size:
        source = getattr(tokenizer, "path", "the tokenizer")
        fix = (
            f"use a matching tokenizer or set {vocab_key} >= {tokenizer.vocab_size}"
            if vocab_key
            else f"{_naming(key, 'TOKENIZER')} with at most {config.vocab_size} tokens (the model's own)"
        )
        raise ConfigError(
            f"tokenizer {source} has {tokenizer.vocab_size} tokens but {model_name} has vocab_size "
            f"{config.vocab_size}, so its top ids would index past the embeddings: {fix}"
        )


def check_same_tokenizer(tokenizer, checkpoint_dir: str | Path, *, key: str) -> None:
    """A checkpoint folder that carries its tokenizer must be used with that tokenizer: a different one of the
    same size would silently map every id to another token. A Hugging Face or Meta folder that carries none
    says nothing of its tokenizer, so the bundled default, which could fit its vocabulary all the same, is refused
    there."""
    folder = Path(checkpoint_dir)
    check_recorded_tokenizer(folder)
    found = find_tokenizer(folder) if folder.is_dir() else None
    if found is not None:
        if Path(tokenizer.path).resolve() == found.resolve():
            return  # read from that very file (data.tokenizer: auto): nothing to compare, nothing to read again
        if load_tokenizer(found).fingerprint != tokenizer.fingerprint:
            leave = "leave it out" if key.startswith("--") else "leave it at auto"
            raise ConfigError(
                f"{checkpoint_dir} carries its tokenizer ({found}), but {key} is {tokenizer.path}: "
                f"{_naming(key, str(found))} or {leave}"
            )
        return
    foreign = any((folder / name).is_file() for name in ("config.json", "params.json", "original/params.json"))
    if foreign and not (folder / "lantern.json").is_file() and tokenizer.fingerprint == load_tokenizer().fingerprint:
        raise ConfigError(
            f"{folder} carries no tokenizer (tokenizer.json, tokenizer.model or original/tokenizer.model): "
            f"{_naming(key, 'TOKENIZER')}, the tokenizer the model was trained with, not the bundled default"
        )


def check_recorded_tokenizer(folder: Path) -> None:
    """A native folder's tokenizer files must be the ones its weights were saved with (lantern.json records their
    sha256): another tokenizer put in their place (a 4,096-token tokenizer.json beside SmolLM2's weights) would
    encode every text into other ids, and generation print garbage with exit 0."""
    try:
        recorded = json.loads((folder / "lantern.json").read_text(encoding="utf-8")).get(TOKENIZER_RECORD) or {}
    except (OSError, ValueError, AttributeError):
        return  # no record (a Hugging Face or Meta folder, an older Lantern's): the other checks apply
    for name, digest in recorded.items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            state = "is missing" if not path.is_file() else "is not the one its weights were saved with"
            raise ConfigError(
                f"{path} {state} (lantern.json records the sha256 of the tokenizer the model was trained with): put "
                f"the model's own {name} back, or convert the model again from its source with its tokenizer"
            )


def resolve_stage_tokenizer(config: Any, start: str | None = None, others: Sequence[tuple[str, str]] = ()) -> None:
    """A stage's ``check_model_tokenizer``, from ``check_stage_config``: ``data.tokenizer`` against the model the
    stage starts from (the ``start`` folder, else its ``model`` section) and every other model folder it reads
    (``others``: (folder, config key), as its stage record declares them). ``data.tokenizer: auto`` becomes the
    tokenizer of the folder the stage starts from, else the bundled default; config.yaml then records which. A
    folder whose config cannot be read is left to the stage to report."""
    data = getattr(config, "data", None)
    if data is None or getattr(data, "tokenizer", None) is None:
        return
    model = _folder_model(start) if start else getattr(config, "model", None)
    if not isinstance(model, ModelConfig):
        data.tokenizer = resolve_tokenizer_spec(data.tokenizer, start)
        return
    if start and source_kind(start) != "folder":
        data.tokenizer = _file_source_tokenizer(data.tokenizer, model, start, Path(config.run.out_dir) / "tokenizers")
    else:
        data.tokenizer, _ = check_model_tokenizer(data.tokenizer, model, start, key="data.tokenizer")
    for folder, _key in others:
        if (other := _folder_model(folder)) is not None:
            check_model_tokenizer(data.tokenizer, other, folder, key="data.tokenizer")


def _file_source_tokenizer(spec: str, model: ModelConfig, start: str, cache: Path) -> str:
    """``check_model_tokenizer`` for a GGUF file or a training checkpoint: 'auto' is the tokenizer it carries (a
    GGUF's written once under ``cache``), and another tokenizer than the one it carries is refused."""
    carried = source_tokenizer(start, cache)
    given = (carried or "default") if str(spec) == "auto" else spec
    resolved, tokenizer = check_model_tokenizer(given, model, None, key="data.tokenizer", vocab_key=None)
    if carried and str(spec) != "auto" and load_tokenizer(carried).fingerprint != tokenizer.fingerprint:
        raise ConfigError(
            f"{start} carries its tokenizer ({carried}), but data.tokenizer is {spec}: "
            f"set data.tokenizer={carried} or leave it at auto"
        )
    return resolved


def _folder_model(folder: str | Path) -> ModelConfig | None:
    """The ModelConfig of a model source (a folder's JSON, a GGUF's metadata, a training checkpoint's config), or
    None when it cannot be read."""
    try:
        return source_model_config(folder)
    except (OSError, ValueError):
        return None


def check_initial_model(config: Any, tokenizer: HasVocab, model: ModelConfig) -> None:
    """A stage that starts from ``init.checkpoint`` (or a seeded ``model``) (SFT, reward model): the tokenizer fits
    the model and is the one the checkpoint carries (the rows' fit to its context is the stage record's rule).
    ``config.model`` is set to the model really built, so that config.yaml and the
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
    check_tokenizer_fits_model(
        tokenizer, model, model_name=source, vocab_key=None if config.init.checkpoint else "model.vocab_size"
    )
    if config.init.checkpoint:
        check_same_tokenizer(tokenizer, config.init.checkpoint, key="data.tokenizer")
        config.model = model


def check_context_length(lengths: dict[str, int], max_seq_len: int, limit: str) -> None:
    """The one context check every stage makes before any compute: the tokens a row can hold (``lengths``, config
    key -> tokens, summed: e.g. a prompt budget plus a response budget) fit the context ``max_seq_len``, named
    ``limit`` in the error (a key such as "model.max_seq_len", or "the policy's max_seq_len")."""
    if sum(lengths.values()) > max_seq_len:
        needed = " + ".join(f"{key} ({tokens})" for key, tokens in lengths.items())
        verb = "exceeds" if len(lengths) == 1 else "exceed"
        raise ConfigError(f"{needed} {verb} {limit} ({max_seq_len})")


def check_steps_left(checkpoint: Path, step: int, config: Any) -> None:
    """A resume from a checkpoint already past ``trainer.max_steps`` is refused: Lightning would stop at once and
    the run export the step-``step`` model as if it had trained to max_steps, config.yaml saying so."""
    trainer = getattr(config, "trainer", None)
    if trainer is not None and step > trainer.max_steps:
        raise ConfigError(
            f"trainer.max_steps={trainer.max_steps}: {checkpoint} is already at step {step}; set trainer.max_steps "
            f"above {step} to train on from it, or run.name to another folder for a new run"
        )


def check_resumed_model(run_dir: Path, config: Any) -> None:
    """A run folder whose checkpoints ``checkpoint.resume=auto`` would resume must be resumed with the model they
    hold (config.yaml records it): another one is refused in one line naming both, before config.yaml changes."""
    model = getattr(config, "model", None)
    if model is None or config.checkpoint.resume != "auto" or not has_checkpoints(run_dir / "checkpoints"):
        return
    try:
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))["model"]
        previous = ModelConfig.from_dict(recorded)
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return  # no readable record: the checkpoint's own shapes are checked when it loads (LanguageModelModule)
    differences = describe_differences(previous, model)
    if differences:
        raise ConfigError(
            f"model: {run_dir} holds checkpoints of another model {differences}: resume it with "
            "its own model, or set run.name to a new folder (or checkpoint.resume=none there) to start afresh"
        )


def resolve_resume(
    config: CheckpointConfig, checkpoint_dir: Path, model: ModelConfig | None = None, stage: Any = None
) -> str | None:
    """The checkpoint to resume: ``auto`` the newest of this run that verifies and loads, if any; ``none`` none; else
    the path given. One of another model than ``model``, or of another optimizer or past a WSD cooldown's start than
    the ``stage`` config's (``check_resumed_optim``), is refused in one line naming both."""
    if config.resume == "none":
        return None
    if config.resume == "auto":
        found = latest_checkpoint(checkpoint_dir)
        if found is None:
            return None
        resume_log.info("resuming from %s", found)
        path = found
    else:
        path = Path(config.resume)
        if not path.exists():
            raise ConfigError(f"checkpoint.resume: {path} does not exist")
    trainer = getattr(stage, "trainer", None)
    if path.is_dir() and trainer is not None and trainer.strategy != "fsdp":
        # a sharded (FSDP2, torch.distributed.checkpoint) folder: only the strategy that wrote it reads it as state
        raise ConfigError(
            f"checkpoint.resume: {path} is a sharded checkpoint an FSDP run wrote (a folder of shards), but "
            f"trainer.strategy is {trainer.strategy}: resume it with trainer.strategy=fsdp, or export it (lantern "
            "export) and start a run from that model with init.checkpoint"
        )
    try:
        header = read_checkpoint_header(path)
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint.resume: {error}") from None
    saved = ((header.get("hyper_parameters") or {}).get("config") or {}).get("model")
    if model is not None and isinstance(saved, dict):
        differences = describe_differences(ModelConfig.from_dict(saved), model)
        if differences:
            raise ConfigError(f"checkpoint.resume: {path} is a checkpoint of another model {differences}")
    if config.resume != "auto" and isinstance(header.get("global_step"), int):  # auto: start_run_directory did
        check_steps_left(path, header["global_step"], stage)
    if stage is not None:
        check_resumed_optim(stage, header, str(path))
    return str(path)


def describe_differences(saved: ModelConfig, configured: ModelConfig) -> str:
    """'(dim 128, ...) than the config's (dim 512, ...)' for the architecture fields that differ; '' if none."""
    differences = architecture_differences(saved, configured)
    if not differences:
        return ""
    was = ", ".join(f"{key} {old}" for key, old, _ in differences)
    now = ", ".join(f"{key} {new}" for key, _, new in differences)
    return f"({was}) than the config's ({now})"


def check_resumable(run_dir: Path, config: Any) -> None:
    """Before config.yaml changes: what ``checkpoint.resume=auto`` would resume in ``run_dir`` is of this model and
    has steps left under ``trainer.max_steps``."""
    check_resumed_model(run_dir, config)
    if config.checkpoint.resume == "auto":
        found = latest_checkpoint(run_dir / "checkpoints", verified=False)
        if found is not None:
            check_steps_left(found, checkpoint_step(found), config)
