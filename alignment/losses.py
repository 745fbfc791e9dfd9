"""Loss reductions of the alignment stages.

Every loss here is computed as this micro-batch's *contribution* to the loss of the whole optimizer step
(all ranks, all accumulation micro-batches): its sum divided by a step-wide count the data pipeline supplies.
Summing contributions over micro-batches and ranks gives the step's loss exactly, so micro-batch 1 x
accumulation 8 and micro-batch 8 x accumulation 1 produce the same update — a mean of per-micro-batch means
would not (it over-weights micro-batches with few tokens).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from models.loss import IGNORE_INDEX


def per_example_mean(token_losses: Tensor, targets: Tensor, document_ids: Tensor) -> Tensor:
    """Mean loss of each example (document) over its supervised tokens, (num_examples,).

    Examples are keyed by (row, document id), so packed rows split into their examples; examples without a
    supervised token do not appear.
    """
    batch, seq_len = targets.shape
    valid = targets != IGNORE_INDEX
    keys = (torch.arange(batch, device=targets.device)[:, None] * (seq_len + 1) + document_ids)[valid]
    _, example_index = torch.unique(keys, return_inverse=True)
    count = int(example_index.max()) + 1 if example_index.numel() else 0
    sums = torch.zeros(count, device=token_losses.device, dtype=token_losses.dtype).index_add_(0, example_index, token_losses[valid])
    sizes = torch.zeros(count, device=token_losses.device, dtype=token_losses.dtype).index_add_(
        0, example_index, torch.ones_like(token_losses[valid])
    )
    return sums / sizes


def sft_loss_contribution(
    token_losses: Tensor,
    targets: Tensor,
    document_ids: Tensor,
    *,
    reduction: Literal["token", "example"],
    step_tokens: Tensor,
    step_examples: Tensor,
) -> Tensor:
    """This micro-batch's share of the step loss.

    ``token``: every supervised token of the step weighs the same, so a 1-token answer packed beside a
    200-token answer gets 1/201 of the weight. ``example``: each example's mean token loss weighs the same,
    whatever its length and whatever it was packed with.
    """
    if reduction == "token":
        return token_losses[targets != IGNORE_INDEX].sum() / step_tokens.clamp(min=1)
    if reduction == "example":
        return per_example_mean(token_losses, targets, document_ids).sum() / step_examples.clamp(min=1)
    raise ValueError(f"loss.reduction must be 'token' or 'example', got {reduction!r}")
