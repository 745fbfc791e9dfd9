"""Rotary position embeddings: the frequencies (with Llama 3.1's or linear scaling), the per-position cos / sin tables
and the rotation of interleaved pairs (Meta's convention; Hugging Face's rotate-half layout is a wq/wk row
permutation on import and export). ``models.model`` re-exports all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # a type only: models.model imports this module
    from models.model import ModelConfig

ROPE_SCALINGS = ("llama3", "linear")  # RopeScaling.rope_type values


@dataclass
class RopeScaling:
    """RoPE scaling for a longer context than the model was pretrained on.

    ``rope_type`` "llama3" (the default, so configs written before the field existed read as before): Llama 3.1's
    frequency-dependent scaling, which uses all four numbers. "linear" (transformers' linear scaling): every
    position divided by ``factor`` (inverse frequencies / factor); the other three numbers are unused.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def problem(self) -> str | None:
        """Why this scaling is invalid (for ``ModelConfig``'s message), or None."""
        if self.rope_type not in ROPE_SCALINGS:
            return f"rope_type must be one of {ROPE_SCALINGS}, got {self.rope_type!r}"
        if self.factor < 1:
            return f"needs factor >= 1, got {self}"
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            return f"needs high_freq_factor > low_freq_factor for llama3 scaling, got {self}"
        return None


def rope_frequencies(config: ModelConfig, device: torch.device | None = None, local: bool = False) -> Tensor:
    """Inverse frequencies (head_dim / 2,) in fp32, with Llama 3.1's or linear scaling when configured. ``local``:
    the sliding-window layers', with base ``rope_local_theta`` and unscaled when that is set (Gemma 3)."""
    dim = config.head_dim
    own = local and config.rope_local_theta is not None
    theta = config.rope_local_theta if own else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    scaling = None if own else config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None:
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen < high_wavelen, inv_freq, torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
        )
    return inv_freq.float()


def rope_cos_sin(config: ModelConfig, position_ids: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
    """cos/sin tables (B, T, head_dim / 2) for the given positions, computed in fp32 (``local``: the sliding-window
    layers' RoPE).

    Computed per forward from positions rather than stored as a buffer: it costs B·T·head_dim/2 multiplies,
    stays fp32 whatever precision the module is cast to, and needs no re-init after meta-device construction.
    """
    inv_freq = rope_frequencies(config, position_ids.device, local)
    angles = position_ids.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x (B, T, H, D) by the position angles."""
    x_pairs = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
