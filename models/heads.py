"""A scalar head over the decoder's final hidden states: the reward model and the PPO critic."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from models.errors import CheckpointError
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.formats.checkpoint_io import read_safetensors
from models.model import ModelConfig, Transformer


class ScalarHead(nn.Module):
    """Linear(dim → 1). ``normal`` init uses std 1/sqrt(dim+1) (as in OpenAI's lm-human-preferences), so
    initial rewards have unit scale; ``zeros`` gives a critic that starts by predicting 0 everywhere."""

    def __init__(self, dim: int, init: Literal["normal", "zeros"] = "normal") -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=True)
        self.init = init
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.init == "normal":
            nn.init.normal_(self.proj.weight, std=1 / math.sqrt(self.proj.in_features + 1))
        elif self.init == "zeros":
            nn.init.zeros_(self.proj.weight)
        else:
            raise ValueError(f"ScalarHead init must be 'normal' or 'zeros', got {self.init!r}")
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.proj(hidden).squeeze(-1).float()


class ScalarModel(nn.Module):
    """The decoder with a scalar head: one score per position, (B, T). The LM head is kept but unused, so
    the backbone stays a plain ``Transformer`` that loads and saves like any other."""

    def __init__(self, config: ModelConfig, init: Literal["normal", "zeros"] = "normal") -> None:
        super().__init__()
        self.backbone = Transformer(config)
        self.head = ScalarHead(config.dim, init)

    @property
    def config(self) -> ModelConfig:
        return self.backbone.config

    @classmethod
    def from_backbone(cls, backbone: Transformer, init: Literal["normal", "zeros"] = "normal") -> ScalarModel:
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model.backbone = backbone
        model.head = ScalarHead(backbone.config.dim, init).to(backbone.tok_embeddings.weight.device)
        return model

    def freeze_lm_head(self) -> ScalarModel:
        """Freeze the LM head nothing reads (untied only: a tied one is the embedding, which trains): it gets no
        optimizer state, and DDP does not wait for a gradient it never receives. Returns the model."""
        if not self.config.tie_embeddings:
            self.backbone.output.weight.requires_grad_(False)
        return self

    def forward(
        self, input_ids: Tensor, *, position_ids: Tensor | None = None, document_ids: Tensor | None = None
    ) -> Tensor:
        hidden = self.backbone.hidden_states(input_ids, position_ids=position_ids, document_ids=document_ids)
        return self.head(hidden)


def last_token_index(mask: Tensor) -> Tensor:
    """Index (B,) of the last True position of each row of a (B, T) mask: where a sequence's score is read.

    Works for left and right padding alike; a row with no True position is an error, not index -1.
    """
    if not bool(mask.any(dim=1).all()):
        raise ValueError("every row needs at least one real token to read a score from")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values


def gather_last(values: Tensor, mask: Tensor) -> Tensor:
    """values (B, T) read at each row's last real token → (B,)."""
    return values.gather(1, last_token_index(mask).unsqueeze(1)).squeeze(1)


HEAD_WEIGHTS = "scalar_head.safetensors"


def save_scalar_model(
    model: ScalarModel,
    directory: str | Path,
    *,
    tokenizer_path: str | Path | Mapping[str, Path] | None = None,
    metadata: dict[str, Any] | None = None,
    state: dict[str, Tensor] | None = None,
) -> Path:
    """A reward model / critic as a native checkpoint folder of its backbone (any tool that reads native
    checkpoints loads the decoder) plus ``scalar_head.safetensors``, written atomically as ``save_checkpoint``
    writes (head included). ``metadata`` (JSON) holds e.g. the reward normalisation. ``state``: a full state dict
    to save instead of the module's own (FSDP gathers)."""
    state = state if state is not None else {name: t.detach().cpu() for name, t in model.state_dict().items()}
    backbone = _backbone_from_state(model.config, state)
    head = {name.removeprefix("head."): t.contiguous() for name, t in state.items() if name.startswith("head.")}
    metadata = {**(metadata or {}), "scalar_head": True, "head_init": model.head.init}
    # the head is written inside the backbone's atomic folder: a failing disk leaves no folder without its head
    return save_checkpoint(
        backbone, directory, tokenizer_path=tokenizer_path, metadata=metadata, extra_weights={HEAD_WEIGHTS: head}
    )


def _backbone_from_state(config: ModelConfig, state: dict[str, Tensor]) -> Transformer:
    with torch.device("meta"):
        backbone = Transformer(config)
    weights = {name.removeprefix("backbone."): t for name, t in state.items() if name.startswith("backbone.")}
    backbone.load_state_dict(weights, assign=True, strict=not config.tie_embeddings)
    if config.tie_embeddings:
        backbone.output.weight = backbone.tok_embeddings.weight
    return backbone


def load_scalar_model(
    path: str | Path, *, dtype: torch.dtype | None = torch.float32
) -> tuple[ScalarModel, dict[str, Any]]:
    """(model, metadata) from a folder written by ``save_scalar_model``."""
    path = Path(path)
    if not (path / HEAD_WEIGHTS).is_file():
        raise FileNotFoundError(
            f"{path} has no {HEAD_WEIGHTS}: not a reward model / critic checkpoint (train one with `lantern rm`)"
        )
    backbone = load_checkpoint(path, dtype=dtype)
    metadata = json.loads((path / "lantern.json").read_text()).get("metadata", {})
    model = ScalarModel.from_backbone(backbone, init=metadata.get("head_init", "normal"))
    head = read_safetensors(path / HEAD_WEIGHTS)
    expected = {name: tuple(t.shape) for name, t in model.head.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in head.items()}
    if found != expected:  # one line naming the file, key and both shapes, not load_state_dict's block
        problems = [
            f"{name}: checkpoint {found.get(name, 'missing')} vs model {expected.get(name, 'unexpected')}"
            for name in sorted(set(found) | set(expected))
            if found.get(name) != expected.get(name)
        ]
        raise CheckpointError(f"{path / HEAD_WEIGHTS} does not match the backbone: {'; '.join(problems)}")
    model.head.load_state_dict(head)
    if dtype is not None:
        model.head.to(dtype)
    return model, metadata
