"""The fused linear + cross-entropy Function against full logits through autograd (values and gradients)."""

import pytest
import torch

from models.loss import (
    IGNORE_INDEX,
    chunked_cross_entropy,
    cross_entropy,
    fused_linear_cross_entropy,
)


def _case(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    hidden = torch.randn(2, 13, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (2, 13))
    targets[1, 5:] = IGNORE_INDEX
    return hidden, weight, targets


def _full(hidden, weight, targets, softcap, z_loss, reduction):
    logits = hidden @ weight.t()
    if softcap:
        logits = softcap * torch.tanh(logits.float() / softcap)
    return cross_entropy(logits, targets, z_loss=z_loss, reduction=reduction)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_fused_equals_full_logits_values_and_gradients(softcap, z_loss, chunk_size):
    hidden, weight, targets = _case(torch.float32)
    # per-token losses with a non-uniform upstream gradient: the backward must scale each token by its own weight
    upstream = torch.rand(2, 13)
    full = _full(hidden, weight, targets, softcap, z_loss, "none")
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, weight))
    fused = fused_linear_cross_entropy(
        hidden, weight, targets, chunk_size=chunk_size, softcap=softcap, z_loss=z_loss, reduction="none"
    )
    fused_grads = torch.autograd.grad((fused * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(fused, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(fused_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.all(fused[1, 5:] == 0)


def test_fused_matches_checkpointed_chunks_and_mean_reduction():
    hidden, weight, targets = _case(torch.float32)
    fused = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=4, z_loss=1e-4)
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk_size=4, z_loss=1e-4)
    torch.testing.assert_close(fused, chunked)
    torch.testing.assert_close(
        torch.autograd.grad(fused, weight)[0], torch.autograd.grad(chunked, weight)[0], atol=1e-6, rtol=1e-5
    )


def test_fused_bf16_close_to_full_logits():
    hidden, weight, targets = _case(torch.float32)
    hidden, weight = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    full = _full(hidden, weight, targets, None, 0.0, "mean")
    fused = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=5)
    torch.testing.assert_close(fused, full)
    for a, b in zip(torch.autograd.grad(fused, (hidden, weight)), torch.autograd.grad(full, (hidden, weight))):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_fused_all_ignored_gives_zero_loss_and_gradient():
    hidden, weight, _ = _case(torch.float32)
    targets = torch.full((2, 13), IGNORE_INDEX)
    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=4)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0 and all(torch.all(g == 0) for g in grads)


def test_fused_rejects_bad_shapes_and_chunk_size():
    hidden, weight, targets = _case(torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        fused_linear_cross_entropy(hidden, weight, targets[:, :3])
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(hidden, weight, targets, chunk_size=0)
