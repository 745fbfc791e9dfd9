"""Language-model losses shared by every stage, per token (stages reduce them differently), without ever holding the
full (B, T, V) fp32 logits.

* ``fused_linear_cross_entropy`` (what the model uses): forward keeps each token's logsumexp (and the last chunk's
  logits); backward recomputes the other chunks' logits and writes the logit gradient in closed form (softmax -
  onehot, scaled), so the only extra work is one head matmul per chunk but the last. Under autocast its backward
  matmuls run in the autocast dtype too.
* ``chunked_cross_entropy``: the same chunking through activation checkpointing; slower, kept as an independent
  reference for the fused path.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
Reduction = Literal["mean", "sum", "none"]


def _token_losses(logits: Tensor, targets: Tensor, ignore_index: int, z_loss: float) -> Tensor:
    """Cross entropy per token in fp32, plus z_loss·logsumexp² (PaLM's z-loss), 0 where ignored."""
    logits = logits.float()
    if not z_loss:
        # torch's fused log-softmax + NLL: its backward holds two (N, V) fp32 buffers where logsumexp - gather held
        # four (docs/plan.md: 8 GiB less for 8,192 tokens of a 128k vocabulary)
        flat = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="none")
        return flat.view(targets.shape)
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


def _check_chunked_arguments(hidden: Tensor, targets: Tensor, chunk_size: int) -> None:
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not match")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


def _chunk_losses(
    hidden: Tensor, weight: Tensor, targets: Tensor, softcap: float | None, ignore_index: int, z_loss: float
) -> Tensor:
    return _token_losses(_project(hidden, weight, softcap), targets, ignore_index, z_loss)


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
    _check_chunked_arguments(hidden, targets, chunk_size)
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


def _compute_dtype(hidden: Tensor) -> torch.dtype | None:
    """The dtype the head's matmuls run in: autocast's where it is on for this device type, else None (as is).

    Read in forward and kept for backward, because Lightning calls ``backward`` outside the autocast context:
    a backward that followed the ambient state would recompute the logits from the fp32 master weights, three
    fp32 matmuls a chunk (the head is ~19% of a 1B model's FLOPs), from other logits than the forward's lse.
    """
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _chunk_forward(raw: Tensor, targets: Tensor, softcap: float | None) -> tuple[Tensor, Tensor]:
    """One chunk's fp32 logsumexp and target logit (chunk,), from its raw logits h·Wᵀ (chunk, V)."""
    logits = _capped(raw, softcap)
    return torch.logsumexp(logits, dim=-1), logits.gather(-1, targets[:, None]).squeeze(-1)


def _chunk_grad_logits(
    raw: Tensor, targets: Tensor, log_z: Tensor, scale: Tensor, scale_p: Tensor, softcap: float | None
) -> Tensor:
    """One chunk's gradient wrt its raw logits h·Wᵀ, in their (the compute) dtype: see the Function."""
    logits = _capped(raw, softcap)
    grad_logits = torch.exp(logits - log_z[:, None]).mul_(scale_p)  # in place: one (chunk, V) buffer eagerly
    grad_logits.scatter_add_(-1, targets[:, None], -scale)
    if softcap is not None:
        grad_logits.mul_(1 - (logits / softcap).square())
    return grad_logits.to(raw.dtype)


_compiled_bodies: tuple[Callable[..., Any], Callable[..., Any]] | None = None


def _chunk_bodies(device_type: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The per-chunk forward and backward bodies: compiled on CUDA, eager elsewhere.

    Compiled, the elementwise work on a (chunk, V) block of raw logits (fp32 cast, soft-cap, logsumexp and gather;
    exp, scaling, scatter, cast) fuses into one pass over it after the cuBLAS matmul, instead of a kernel and a
    round trip through memory per op. On CPU the tests' small shapes would spend far longer compiling than
    running, and CPU is not where throughput matters. Compiled once, lazily, like FlexAttention's kernel.
    """
    global _compiled_bodies
    if device_type != "cuda":
        return _chunk_forward, _chunk_grad_logits
    if _compiled_bodies is None:
        _compiled_bodies = (
            torch.compile(_chunk_forward, fullgraph=True),
            torch.compile(_chunk_grad_logits, fullgraph=True),
        )
    return _compiled_bodies


def _autocast_off(device_type: str, compute_dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    """Autocast switched off while the forward's chunks run, so that they run exactly backward's ops."""
    return torch.autocast(device_type, enabled=False) if compute_dtype is not None else nullcontext()


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Per-token CE of ``hidden @ weight.T`` (optionally soft-capped, plus z-loss); logits recomputed per chunk.

    With c = softcap, raw = h·Wᵀ, logits = c·tanh(raw/c), p = softmax(logits), lse = logsumexp(logits):
    loss = lse - logits[target] + z·lse², so dloss/dlogits = p·(1 + 2z·lse) - onehot(target), and the tanh
    contributes a factor 1 - (logits/c)². The gradient wrt raw is cast to the compute dtype before the two
    backward matmuls, as autograd would do through ``.float()`` on the full-logits path.

    The compute dtype is autocast's when the forward runs under autocast (``_compute_dtype``): forward and
    backward then cast hidden and weight to it explicitly, so every head matmul runs in it and backward
    recomputes bit for bit the logits whose lse the forward kept. Losses, lse and the weight's gradient
    accumulate in fp32 either way; gradients come back in the inputs' dtypes, as through autocast.
    """

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int, softcap: float | None,
        ignore_index: int, z_loss: float,
    ) -> Tensor:  # fmt: skip
        compute_dtype = _compute_dtype(hidden)
        hidden_c, weight_c = _cast(hidden, compute_dtype), _cast(weight, compute_dtype)
        chunk_forward, _ = _chunk_bodies(hidden.device.type)
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        log_z = torch.empty(targets.shape, device=hidden.device, dtype=torch.float32)
        target_logits = torch.empty_like(log_z)
        raw = None  # no tokens: no chunk
        with _autocast_off(hidden.device.type, compute_dtype):
            for start in range(0, targets.numel(), chunk_size):
                end = start + chunk_size
                raw = hidden_c[start:end] @ weight_c.t()
                log_z[start:end], target_logits[start:end] = chunk_forward(raw, safe_targets[start:end], softcap)
        losses = log_z - target_logits
        if z_loss:
            losses = losses + z_loss * log_z.square()
        losses = torch.where(valid, losses, torch.zeros_like(losses))
        # The last chunk's raw logits are kept for backward, which starts with them and then drops them: one head
        # matmul fewer, all of the recomputation when one chunk holds every token (docs/benchmarks.md, the families
        # on CPU). An attribute, not a saved tensor, so that backward can free it (autograd would hold a saved one
        # to the end of backward); a second backward (retain_graph) finds it gone and recomputes.
        ctx.last_raw = raw if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] else None
        ctx.save_for_backward(hidden, weight, safe_targets, valid, log_z)
        ctx.chunk_size, ctx.softcap, ctx.z_loss, ctx.compute_dtype = chunk_size, softcap, z_loss, compute_dtype
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, valid, log_z = ctx.saved_tensors
        last, ctx.last_raw = ctx.last_raw, None
        softcap, z_loss = ctx.softcap, ctx.z_loss
        # cast once, not a chunk at a time: a bf16 copy of the head lives for this backward only
        hidden_c, weight_c = _cast(hidden, ctx.compute_dtype), _cast(weight, ctx.compute_dtype)
        _, chunk_grad_logits = _chunk_bodies(hidden.device.type)
        grad_losses = torch.where(valid, grad_losses.float(), torch.zeros_like(log_z))
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight: Tensor | None = None  # fp32; the first chunk's product starts it (no zero-filled V x dim buffer)
        starts = range(0, targets.numel(), ctx.chunk_size)
        for start in reversed(starts):  # the kept last chunk first, then it is freed
            end = start + ctx.chunk_size
            scale = grad_losses[start:end, None]
            scale_p = scale * (1 + 2 * z_loss * log_z[start:end, None]) if z_loss else scale
            if start == starts[-1] and last is not None:
                raw, last = last, None
            else:
                raw = hidden_c[start:end] @ weight_c.t()
            grad_logits = chunk_grad_logits(raw, targets[start:end], log_z[start:end], scale, scale_p, softcap)
            del raw
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight_c
            if ctx.needs_input_grad[1]:
                if grad_weight is None:
                    grad_weight = (grad_logits.t() @ hidden_c[start:end]).float()
                elif grad_weight.dtype == weight_c.dtype:
                    grad_weight.addmm_(grad_logits.t(), hidden_c[start:end])
                else:  # low-precision matmuls: accumulate chunks in fp32, round once at the end
                    grad_weight.add_(grad_logits.t() @ hidden_c[start:end])
        if ctx.needs_input_grad[1] and grad_weight is None:  # no tokens at all
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, None


def _cast(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def _project(hidden: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
    """One chunk's fp32 logits (chunk, V), soft-capped when configured."""
    return _capped(hidden @ weight.t(), softcap)


def _capped(raw: Tensor, softcap: float | None) -> Tensor:
    logits = raw.float()
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def fused_linear_cross_entropy(
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
    """Cross entropy of ``hidden @ weight.T`` (hidden (..., dim), weight (V, dim), targets (...)) in fp32.

    Equals ``cross_entropy`` of the full logits in value and gradient, while holding one (chunk_size, V) block
    of logits at a time, in forward and in backward.
    """
    _check_chunked_arguments(hidden, targets, chunk_size)
    flat = _FusedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk_size, softcap, ignore_index, z_loss
    )
    # clone: a view returned from an FSDP2 root method would lose its pre-backward hook to any in-place op
    return reduce_losses(flat.view(targets.shape).clone(), targets, reduction, ignore_index)
