"""The fused linear + cross-entropy Function against full logits through autograd (values and gradients), in fp32
and under bf16 autocast (where every head matmul, backward's too, must run in bf16)."""

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from models import loss as loss_module
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


class _MatmulDtypes(TorchDispatchMode):
    """Records (op name, input dtypes) of every matmul that reaches aten, in forward and in backward."""

    MATMULS = ("mm", "addmm", "bmm", "matmul", "baddbmm")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name in self.MATMULS:
            self.calls.append((func.overloadpacket.__name__, tuple(a.dtype for a in args if isinstance(a, Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loss_fn", [fused_linear_cross_entropy, chunked_cross_entropy])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_chunked_loss_matmuls_run_in_autocast_dtype_forward_and_backward(loss_fn, softcap):
    """Under bf16 autocast every head matmul is bf16, backward's too, though backward runs outside autocast.

    Lightning calls ``backward`` after leaving the autocast context; a backward that recomputes logits with
    the fp32 master weights would run the head's three matmuls a chunk in fp32 (and from other logits than
    the forward's log-sum-exp), which is what chunking used to cost in MFU.
    """
    hidden, weight, targets = _case(torch.float32)
    with _MatmulDtypes() as forward_log, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(hidden, weight, targets, chunk_size=8, softcap=softcap)
    with _MatmulDtypes() as backward_log:
        loss.backward()
    chunks = 4  # 26 tokens, 8 a chunk
    # forward: one matmul a chunk; backward: the recomputed logits and the two gradient matmuls (the fused loss keeps
    # its last chunk's logits from the forward: one recomputation fewer)
    kept = 1 if loss_fn is fused_linear_cross_entropy else 0
    assert len(forward_log.calls) == chunks and len(backward_log.calls) == 3 * chunks - kept
    for name, dtypes in forward_log.calls + backward_log.calls:
        assert all(d == torch.bfloat16 for d in dtypes), (name, dtypes)
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32


def test_tokens_in_one_chunk_are_never_recomputed():
    """Every token in one chunk: backward runs only the two gradient matmuls, from the forward's logits, and gives
    the full-logits gradients."""
    hidden, weight, targets = _case(torch.float32)
    with _MatmulDtypes() as forward_log:
        loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=64, softcap=5.0)
    with _MatmulDtypes() as backward_log:
        grads = torch.autograd.grad(loss, (hidden, weight))
    assert len(forward_log.calls) == 1 and len(backward_log.calls) == 2
    reference = torch.autograd.grad(_full(hidden, weight, targets, 5.0, 0.0, "mean"), (hidden, weight))
    for ours, theirs in zip(grads, reference):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_a_second_backward_recomputes_the_chunk_the_first_freed():
    """retain_graph: the first backward used and dropped the forward's last chunk; the second recomputes it."""
    hidden, weight, targets = _case(torch.float32)
    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("loss_fn", [fused_linear_cross_entropy, chunked_cross_entropy])
@pytest.mark.parametrize(("softcap", "z_loss"), [(None, 0.0), (5.0, 1e-2)])
def test_chunked_loss_under_autocast_matches_full_logits(loss_fn, softcap, z_loss):
    """Values and gradients against full logits under the same autocast, within bf16 tolerance.

    Backward recomputing fp32 logits from the fp32 weights missed the reference's hidden-state gradient by
    4e-2 here; from the forward's bf16 logits it is within the rounding of each chunk's weight gradient.
    """
    hidden, weight, targets = _case(torch.float32)
    upstream = torch.rand(2, 13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = _full(hidden, weight, targets, softcap, z_loss, "none")
        chunked = loss_fn(hidden, weight, targets, chunk_size=5, softcap=softcap, z_loss=z_loss, reduction="none")
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, weight))
    chunked_grads = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)  # same bf16 logits, fp32 reductions
    for a, b in zip(chunked_grads, full_grads):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_per_chunk_bodies_compiled_on_cuda_only(monkeypatch):
    """CUDA gets the per-chunk bodies compiled, once; other devices run them eagerly (nothing compiled)."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn) or fn)
    monkeypatch.setattr(loss_module, "_compiled_bodies", None)
    assert loss_module._chunk_bodies("cpu") == (loss_module._chunk_forward, loss_module._chunk_grad_logits)
    assert compiled == []
    loss_module._chunk_bodies("cuda")
    loss_module._chunk_bodies("cuda")
    assert compiled == [loss_module._chunk_forward, loss_module._chunk_grad_logits]


def test_compiled_per_chunk_bodies_give_the_eager_numbers(monkeypatch):
    """The bodies CUDA runs compiled, compiled here by inductor's CPU backend: the same losses and gradients."""
    pytest.importorskip("torch._inductor")
    hidden, weight, targets = _case(torch.float32)
    upstream = torch.rand(2, 13)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = fused_linear_cross_entropy(
                hidden, weight, targets, chunk_size=8, softcap=5.0, z_loss=1e-2, reduction="none"
            )
        return (losses, *torch.autograd.grad((losses * upstream).sum(), (hidden, weight)))

    eager = run()
    monkeypatch.setattr(loss_module, "_compiled_bodies", None)
    cuda_bodies = loss_module._chunk_bodies("cuda")
    monkeypatch.setattr(loss_module, "_chunk_bodies", lambda device_type: cuda_bodies)
    compiled = run()
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(compiled[1:], eager[1:]):  # a bf16 rounding of a logit gradient may differ by one ulp
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_no_tokens_give_zero_loss_and_zero_gradients():
    """A batch of no tokens (a reduction of nothing) runs forward and backward with no chunk at all."""
    hidden = torch.randn(2, 0, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    loss = fused_linear_cross_entropy(hidden, weight, torch.zeros(2, 0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.shape == (2, 0, 16)
    assert torch.equal(weight.grad, torch.zeros_like(weight))
