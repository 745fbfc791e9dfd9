"""Muon for the transformer blocks' matrices and AdamW for the rest, as one ``torch.optim.Optimizer``: Lightning's
automatic optimisation takes one optimizer, and one LambdaLR then scales every group from its own initial lr."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import CheckpointError
from models.model import TransformerBlock


def muon_parameters(model: nn.Module) -> list[Tensor]:
    """The 2-D weights of the transformer blocks that train (attention and MLP projections), in model order: what
    Muon orthogonalises. Embeddings, the output head (tied or not), norms, biases and scalar heads sit outside the
    blocks or are not matrices, and stay with AdamW; so do LoRA's low-rank factors (``lora_``), whose product, not
    each factor, is the weight update."""
    in_blocks = {
        id(p) for module in model.modules() if isinstance(module, TransformerBlock) for p in module.parameters()
    }
    found, seen = [], set()
    for name, parameter in model.named_parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        if parameter.requires_grad and parameter.ndim == 2 and id(parameter) in in_blocks and "lora_" not in name:
            found.append(parameter)
    return found


class _JointState(MutableMapping):
    """The inner optimizers' ``state`` as one mapping (what Lightning and the NaN/Inf check iterate), read live: an
    inner ``load_state_dict`` replaces its own mapping."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def _owner(self, key: Tensor) -> torch.optim.Optimizer:
        for optimizer in self._optimizers:
            if key in optimizer.state or any(key is p for g in optimizer.param_groups for p in g["params"]):
                return optimizer
        raise KeyError(key)

    def __getitem__(self, key: Tensor) -> Any:
        return self._owner(key).state[key]

    def __setitem__(self, key: Tensor, value: Any) -> None:
        self._owner(key).state[key] = value

    def __delitem__(self, key: Tensor) -> None:
        del self._owner(key).state[key]

    def __iter__(self) -> Iterator[Tensor]:
        for optimizer in self._optimizers:
            yield from optimizer.state

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self._optimizers)


class MuonWithAdamW(torch.optim.Optimizer):
    """``adamw``'s groups then ``muon``'s, as this optimizer's ``param_groups`` (the same dicts, so a scheduler's lr
    reaches them); step, zero_grad and the state dict go to both. ``param_groups[0]`` stays AdamW's, whose lr is
    ``optim.lr``: the lr a run logs is the same quantity with either optimizer."""

    def __init__(self, adamw: torch.optim.Optimizer, muon: torch.optim.Optimizer) -> None:
        self.adamw, self.muon = adamw, muon
        self.optimizers = [adamw, muon]
        super().__init__([*adamw.param_groups, *muon.param_groups], defaults={})
        self.state = _JointState(self.optimizers)  # type: ignore[assignment]

    def _regroup(self) -> None:
        # in place: a LightningOptimizer holds a copy of this object's __dict__, so the list itself must stay
        self.param_groups[:] = [*self.adamw.param_groups, *self.muon.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if set(state_dict) != {"adamw", "muon"}:
            raise CheckpointError(
                "the optimizer state being loaded is not Muon + AdamW's (optim.name muon): resume with the optim.name "
                "it was saved with"
            )
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])
        self._regroup()
