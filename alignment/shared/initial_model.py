"""The model a stage starts from (``load_initial_model``): a model source (a native, Hugging Face or Meta folder, a
GGUF file or a training checkpoint, read in fp32, drawing nothing from the RNG), else a new model built right after ``torch.manual_seed(run.seed)``, so every rank
and every run builds the same weights. It lives above models/ and trainer/ because it reads stage config sections.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.adapters import add_adapters, base_fingerprint
from models.model import Transformer
from trainer.model_sources import load_source_model

log = logging.getLogger(__name__)


def load_initial_model(config: Any, key: str = "checkpoint") -> Transformer:
    """The model of ``config.init.<key>`` (any source ``load_source_model`` reads), else ``Transformer(config.model)``
    built right after ``torch.manual_seed(config.run.seed)``."""
    path = getattr(config.init, key)
    if path:
        return load_source_model(path, dtype=torch.float32)
    torch.manual_seed(config.run.seed)
    return Transformer(config.model)


def add_stage_adapters(
    config: Any, model: nn.Module, key: str = "checkpoint", base: nn.Module | None = None, trainable: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """With ``peft.kind: lora``, add the section's adapters to ``model`` (in place; ``trainable``: the parameters that
    train beside them) and return what the module's checkpoints keep of its base, ``{"model": record}``: the folder
    ``init.<key>`` (or the seed and model of a seeded base) and the fingerprint of ``base`` (default ``model``), taken
    before the adapters are added. Without peft, ``{}``: the module trains and checkpoints every weight."""
    if not config.peft.enabled:
        return {}
    return {"model": add_model_adapters(config, model, getattr(config.init, key), base=base, trainable=trainable)}


def add_model_adapters(
    config: Any, model: nn.Module, path: str | None, base: nn.Module | None = None, trainable: Sequence[str] = ()
) -> dict[str, Any]:
    """Add the ``peft`` section's adapters to ``model`` (in place) and return its base's record: the folder ``path``
    the base was read from (or, for a seeded base, ``run.seed``), the model config and the fingerprint of ``base``
    (default ``model``), taken before the adapters are added. ``add_stage_adapters`` for a model whose folder is
    not an ``init`` key: PPO's critic, copied from the reward model of ``reward.terms``."""
    base = model if base is None else base
    record = {
        "checkpoint": str(Path(path).resolve()) if path else None,
        "seed": None if path else config.run.seed,
        "model": base.config.to_dict(),
        "fingerprint": base_fingerprint(base),
    }
    # The adapters' A matrices are drawn at random: from run.seed, so every rank and every run (a resume's too, and
    # a second stage in one process) starts from the same ones, and the caller's random state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.run.seed)
        add_adapters(model, config.peft, trainable)
    log.info(
        "LoRA adapters (rank %d): %s of %s parameters train",
        config.peft.rank,
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,}",
        f"{sum(p.numel() for p in model.parameters()):,}",
    )
    return record
