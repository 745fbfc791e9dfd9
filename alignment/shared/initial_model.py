"""The model a stage starts from: a checkpoint folder, else a new model seeded with ``run.seed``.

SFT and the reward model's backbone start from ``init.checkpoint``, DPO's policy from ``init.policy`` and its
reference from ``init.reference``; ``load_initial_model`` loads every one of them, so the seeding is one rule: a
checkpoint (native, Hugging Face or Meta) is read in fp32 and draws nothing from the RNG; with none,
``torch.manual_seed(run.seed)`` comes right before ``Transformer(model)``, so every rank and every run builds
the same weights.

Why here, in alignment/shared/: it is the lowest layer that knows what it reads. The ``init``, ``run`` and
``model`` sections are the stage schemas' (alignment/schemas), and seeding the global RNG with the run's seed is
a stage's decision; models/ (the Transformer, the checkpoint formats) and trainer/ (the Lightning
infrastructure) know no stage config. alignment/stages/sft.py, reward.py (through ``load_initial_reward_model``)
and dpo.py all import it from here, below them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.adapters import add_adapters, base_fingerprint
from models.checkpoint import load_checkpoint
from models.model import Transformer


def load_initial_model(config: Any, key: str = "checkpoint") -> Transformer:
    """The model of ``config.init.<key>`` (a checkpoint folder), else ``Transformer(config.model)`` built right
    after ``torch.manual_seed(config.run.seed)``."""
    path = getattr(config.init, key)
    if path:
        return load_checkpoint(path, dtype=torch.float32)
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
    path = getattr(config.init, key)
    record = {
        "checkpoint": str(Path(path).resolve()) if path else None,
        "seed": None if path else config.run.seed,
        "model": (base or model).config.to_dict(),
        "fingerprint": base_fingerprint(base or model),
    }
    add_adapters(model, config.peft, trainable)
    return {"model": record}
