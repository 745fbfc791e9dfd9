"""Language-model losses shared by every stage.

Per-token losses are returned (not only their mean) because stages reduce differently: pretraining averages
over tokens, SFT's ``example`` reduction averages per document first, PPO normalises by the accumulated
batch's valid tokens.

The chunked path never holds the full (B, T, V) fp32 logits: each chunk of tokens is projected, scored and
dropped, and recomputed in backward (activation checkpointing per chunk). For Llama 3's V=128256 at T=4096
that is the difference between gigabytes of logits and one chunk's worth (``benchmarks/bench_loss_memory.py``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
Reduction = Literal["mean", "sum", "none"]


def _token_losses(logits: Tensor, targets: Tensor, ignore_index: int, z_loss: float) -> Tensor:
    """Cross entropy per token in fp32, plus z_loss·logsumexp² (PaLM's z-loss), 0 where ignored."""
    logits = logits.float()
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    log_z = torch.logsumexp(logits, dim=-1)
    target_logits = logits.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    losses = log_z - target_logits
    if z_loss:
        losses = losses + z_loss * log_z.square()
    return torch.where(valid, losses, torch.zeros_like(losses))


def reduce_losses(losses: Tensor, targets: Tensor, reduction: Reduction, ignore_index: int = IGNORE_INDEX) -> Tensor:
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        # clamp: a batch with no supervised token gives loss 0 (and zero gradient), not NaN
        return losses.sum() / (targets != ignore_index).sum().clamp(min=1)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def cross_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    z_loss: float = 0.0,
    reduction: Reduction = "mean",
) -> Tensor:
    """Cross entropy of logits (..., V) against targets (...), computed in fp32."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match")
    return reduce_losses(_token_losses(logits, targets, ignore_index, z_loss), targets, reduction, ignore_index)


def _chunk_losses(
    hidden: Tensor, weight: Tensor, targets: Tensor, softcap: float | None, ignore_index: int, z_loss: float
) -> Tensor:
    logits = hidden @ weight.t()
    if softcap is not None:
        logits = softcap * torch.tanh(logits.float() / softcap)
    return _token_losses(logits, targets, ignore_index, z_loss)


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = 1024,
    softcap: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    z_loss: float = 0.0,
    reduction: Reduction = "mean",
) -> Tensor:
    """Cross entropy of ``hidden @ weight.T`` without materialising the full logits.

    hidden (..., dim), weight (V, dim) (the LM head), targets (...). Tokens are processed ``chunk_size`` at a
    time; each chunk's logits are recomputed in backward instead of being kept.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not match")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    pieces = []
    for start in range(0, flat_targets.numel(), chunk_size):
        chunk = (flat_hidden[start : start + chunk_size], weight, flat_targets[start : start + chunk_size])
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            pieces.append(checkpoint(_chunk_losses, *chunk, softcap, ignore_index, z_loss, use_reentrant=False))
        else:
            pieces.append(_chunk_losses(*chunk, softcap, ignore_index, z_loss))
    # clone: a view returned from an FSDP2 root method would lose its pre-backward hook to any in-place op
    losses = torch.cat(pieces).view(targets.shape).clone()
    return reduce_losses(losses, targets, reduction, ignore_index)
