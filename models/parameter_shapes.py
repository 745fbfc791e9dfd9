"""The parameters of a model as its memory plan counts them: every distinct tensor's shape, whether it trains and
whether it sits in a transformer block, read from a meta-device model (with LoRA adapters or a scalar head when
asked), never from a formula."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from models.model import ModelConfig, Transformer, TransformerBlock
from models.model_config import PeftConfig

__all__ = ["ParameterShapes", "build_meta_model", "meta_parameters", "parameter_shapes"]


@dataclass(frozen=True)
class ParameterShapes:
    """Every distinct parameter of a model (tied ones once): its shape, whether it trains, and whether it sits in a
    transformer block (what FSDP2 shards and gathers block by block) or at the root (embeddings, final norm, heads)."""

    tensors: tuple[tuple[tuple[int, ...], bool, bool], ...]  # (shape, trains, in a block)
    n_blocks: int

    def numel(self, *, trains: bool | None = None, in_block: bool | None = None) -> int:
        return sum(
            math.prod(shape)
            for shape, trainable, block in self.tensors
            if (trains is None or trainable == trains) and (in_block is None or block == in_block)
        )

    @property
    def total(self) -> int:
        return self.numel()

    @property
    def trainable(self) -> int:
        return self.numel(trains=True)

    @property
    def trainable_tensors(self) -> int:
        return sum(1 for _, trainable, _ in self.tensors if trainable)

    def shard_numel(self, world: int, rank: int = 0, *, trains: bool | None = None) -> int:
        """Elements rank ``rank`` of ``world`` holds when FSDP2 shards every parameter on dim 0 (torch.chunk's
        split: ceil(rows / world) rows to each rank in turn, the last ones fewer or none)."""
        total = 0
        for shape, trainable, _ in self.tensors:
            if trains is not None and trainable != trains:
                continue
            rows, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            per_rank = -(-rows // world)
            total += max(0, min(per_rank, rows - rank * per_rank)) * rest
        return total

    def block_numel(self, *, trains: bool | None = None) -> int:
        """Elements of one transformer block (they are all alike); ``trains``: only those that train (or not)."""
        return self.numel(trains=trains, in_block=True) // max(self.n_blocks, 1)


def build_meta_model(
    config: ModelConfig, *, scalar_head: bool = False, peft: PeftConfig | None = None, trainable: tuple[str, ...] = ()
) -> nn.Module:
    """The model a stage trains, on the meta device (no memory): a ``Transformer``, or a ``ScalarModel`` (reward model,
    critic) whose unused LM head is frozen, with ``peft``'s LoRA adapters when enabled (``trainable``: what trains
    beside them, e.g. a scalar head's ``head.``)."""
    from models.heads import ScalarModel  # heads reads checkpoints: imported only when a scalar model is asked for

    with torch.device("meta"):
        model: nn.Module = Transformer(config)
        if scalar_head:
            model = ScalarModel.from_backbone(model).freeze_lm_head()
    if peft is not None and peft.enabled:
        from models.adapters import add_adapters  # peft: only for adapters

        with torch.device("meta"):
            add_adapters(model, peft, trainable)
    return model


def parameter_shapes(model: nn.Module) -> ParameterShapes:
    """Every distinct parameter of ``model``, a real one or one built by ``build_meta_model``."""
    seen: set[int] = set()
    tensors = []
    for name, parameter in model.named_parameters():
        if id(parameter) in seen:  # tied weights appear twice
            continue
        seen.add(id(parameter))
        tensors.append((tuple(parameter.shape), parameter.requires_grad, ".layers." in f".{name}"))
    blocks = sum(1 for module in model.modules() if isinstance(module, TransformerBlock))
    return ParameterShapes(tuple(tensors), max(blocks, 1))


@functools.lru_cache(maxsize=64)
def _meta_parameters(config: str, scalar_head: bool, peft: str, trainable: tuple[str, ...]) -> ParameterShapes:
    model_config = ModelConfig.from_dict(json.loads(config))
    peft_config = PeftConfig(**json.loads(peft)) if peft else None
    model = build_meta_model(model_config, scalar_head=scalar_head, peft=peft_config, trainable=trainable)
    return parameter_shapes(model)


def meta_parameters(
    config: ModelConfig, *, scalar_head: bool = False, peft: PeftConfig | None = None, trainable: tuple[str, ...] = ()
) -> ParameterShapes:
    """The parameters of the model ``build_meta_model`` makes, counted once per distinct config (knob searches plan
    the same models many times)."""
    key = json.dumps(config.to_dict(), sort_keys=True)
    peft_key = json.dumps(asdict(peft), sort_keys=True) if peft is not None and peft.enabled else ""
    return _meta_parameters(key, scalar_head, peft_key, tuple(trainable))
