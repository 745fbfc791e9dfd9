"""LoRA adapters through ``peft``'s own layers: adding them (``add_adapters``), a reference pass with them off
(``adapters_disabled``), folding them in (``merge_adapters``), and the fingerprint that ties them to their base
(``base_fingerprint``). Targets are the blocks' projections, by Lantern's or Hugging Face's names; never the LM head.
"""

from __future__ import annotations

import hashlib
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from models.errors import ConfigError
from models.model_config import HF_TARGETS, LORA_TARGETS, PeftConfig, lantern_targets

if TYPE_CHECKING:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

# peft (and the transformers it imports) loads on first use, not with the trainer: each training process and rank
# that trains no adapter starts ~0.7 s sooner.


def lora_config(config: PeftConfig, targets: Sequence[str] | None = None) -> LoraConfig:
    """peft's ``LoraConfig`` for the section (``targets``: other layer names, e.g. Hugging Face's, for an export)."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(targets if targets is not None else lantern_targets(config)),
        bias="none",
    )


def check_peft_config(config: PeftConfig, model: nn.Module, key: str = "peft") -> None:
    """One line naming the key: a target that is not one of the blocks' projections, or none at all (the other
    fields' ranges are checked at load)."""
    if not config.enabled:
        return
    targets = lantern_targets(config)
    if not targets:
        raise ConfigError(f"{key}.target_modules is empty: name the layers to adapt, e.g. {list(LORA_TARGETS)}")
    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    unknown = [name for name in config.target_modules if HF_TARGETS.get(name, name) not in present]
    if unknown or "output" in targets:
        wrong = unknown or ["output"]
        raise ConfigError(
            f"{key}.target_modules {wrong} match no projection of the model's blocks: choose among "
            f"{list(LORA_TARGETS)} (or Hugging Face's {list(HF_TARGETS)})"
        )


def add_adapters(model: nn.Module, config: PeftConfig, trainable: Sequence[str] = ()) -> nn.Module:
    """Freeze ``model`` and add peft's LoRA layers (trainable) to the blocks' target projections, in place; the
    parameters whose names start with one of ``trainable`` (a reward model's ``head.``) train too. Returns ``model``,
    which remembers ``config`` (``adapter_config``) for exports."""
    from peft import inject_adapter_in_model

    check_peft_config(config, model)
    inject_adapter_in_model(lora_config(config), model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name or name.startswith(tuple(trainable)))
    model.adapter_config = config
    return model


def adapter_layers(model: nn.Module) -> list[BaseTunerLayer]:
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:  # peft never loaded in this process, so no adapter was added
        return []
    return [module for module in model.modules() if isinstance(module, tuners.BaseTunerLayer)]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base inside: the adapters' forward is skipped (their flags untouched). A no-op for a
    model without adapters. Compiled blocks compile this second variant once."""
    layers = adapter_layers(model)
    previous = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, state in zip(layers, previous):
            layer._disable_adapters = state


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (peft's ``merge``) and put the plain ``nn.Linear`` back, in place:
    the model peft's ``merge_and_unload`` gives, under Lantern's names. Returns ``model``."""
    layers = set(adapter_layers(model))
    for name, module in list(model.named_modules()):
        if module in layers:
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    if hasattr(model, "adapter_config"):
        del model.adapter_config
    return model


def base_fingerprint(model: nn.Module) -> str:
    """Which base an adapter belongs to: every tensor's name, shape, dtype and the CRC-32 of its bytes (peft's adapter
    layers and names are left out, so a model with adapters has its base's fingerprint)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()  # its buffer, no copy
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{zlib.crc32(data)}".encode())
    return digest.hexdigest()[:16]


def trained_names(model: nn.Module) -> set[str]:
    """The names of the parameters that train (``named_parameters``' names)."""
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}


def merged_state(state: dict[str, torch.Tensor], config: PeftConfig, build: Callable[[], nn.Module]) -> dict:
    """A model-with-adapters' weights (``state``, e.g. gathered from every FSDP2 rank) as the plain model's: the
    model ``build`` makes is built on the meta device, given the adapters, loaded with ``state`` and merged."""
    from peft import inject_adapter_in_model

    with torch.device("meta"):
        model = build()
    inject_adapter_in_model(lora_config(config), model)
    model.load_state_dict(state, assign=True, strict=True)
    return merge_adapters(model).state_dict()
