"""LoRA adapters through ``peft``: the ``peft`` config section, adding adapters to a model, switching them off for
a reference pass, folding them into the weights, and the fingerprint that ties an adapter to its base.

Choices:
- peft's own layers (``inject_adapter_in_model``), not a wrapper model: the model stays a ``Transformer`` (or a
  ``ScalarModel``) with its methods and names, so activation checkpointing, ``torch.compile`` and FSDP2 apply to it
  as to any other (trainer/parallel.py), and only the adapted ``nn.Linear`` layers change. Their parameter names are
  peft's (``layers.0.attention.wq.base_layer.weight``, ``....wq.lora_A.default.weight``); ``merge_adapters`` gives a
  plain model back, and ``models/hf_format.py`` writes the adapter in peft's own file format.
- The reference of DPO, PPO and GRPO is the same model with its adapters off (``adapters_disabled``), as TRL does:
  no second copy of the weights. It switches the layers' forward only. peft's ``enable_adapters(False)`` also flips
  the adapters' ``requires_grad``, which under FSDP2 would change a sharded parameter's flag between its all-gathers.
- Targets are the blocks' projections, by Lantern's names (``wq wk wv wo w1 w2 w3``) or by Hugging Face's
  (``q_proj`` ... ``up_proj``), which peft users write. The LM head is not a target: the chunked and fused losses
  read its weight directly (models/loss.py), so an adapter there would be skipped.
- A base is known by ``base_fingerprint``: every tensor's name, shape, dtype and a CRC-32 of all its bytes, so an
  adapter is never resumed or exported onto another model, even one that differs in a single weight. CRC-32 runs at
  ~2 GB/s on one core (1 s for the 2 GB fp32 embedding of Llama 3; a SHA-256 took 2.1 s, a float64 sum 17 s).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from models.adapter_config import HF_TARGETS, LORA_TARGETS, PeftConfig, lantern_targets
from models.errors import ConfigError


def lora_config(config: PeftConfig, targets: Sequence[str] | None = None) -> LoraConfig:
    """peft's ``LoraConfig`` for the section (``targets``: other layer names, e.g. Hugging Face's, for an export)."""
    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(targets if targets is not None else lantern_targets(config)),
        bias="none",
    )


def check_peft_config(config: PeftConfig, model: nn.Module, key: str = "peft") -> None:
    """One line naming the key: a target that is not one of the blocks' projections, or none at all. The rank's,
    alpha's and dropout's ranges are models/config_checks.py's."""
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
    check_peft_config(config, model)
    inject_adapter_in_model(lora_config(config), model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name or name.startswith(tuple(trainable)))
    model.adapter_config = config
    return model


def adapter_layers(model: nn.Module) -> list[BaseTunerLayer]:
    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


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
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
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
    with torch.device("meta"):
        model = build()
    inject_adapter_in_model(lora_config(config), model)
    model.load_state_dict(state, assign=True, strict=True)
    return merge_adapters(model).state_dict()
