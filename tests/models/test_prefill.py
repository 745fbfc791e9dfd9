"""Scoring rows that share a prefix with the prefix run once (``models.prefill.logits_with_shared_prefix``, RL's
reference and training passes): the full forward's logits and gradients, under activation checkpointing and FSDP2
too, and traceable whole by ``torch.compile(fullgraph=True)`` as compiled blocks need."""

from __future__ import annotations

import pytest
import torch

from alignment.shared.losses import logprobs_and_entropy
from alignment.shared.responses import response_logprobs
from models.generation import ids_and_positions, left_pad
from models.prefill import logits_with_shared_prefix, shared_prefix_length
from tests.helpers import spawn_ranks
from tests.models.test_generation import SYSTEM, tiny_model
from trainer.parallel import apply_activation_checkpointing, transformer_blocks

PROMPTS = [SYSTEM + [5, 17, 99], SYSTEM + [7], SYSTEM + [100, 1, 64, 33, 2], SYSTEM + [7, 8]]
RESPONSE_LENGTHS = [3, 6, 1, 6]  # right-padded to 6, one ends at once


def rows() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts + right-padded responses (B, P + N), the real-token mask, and P."""
    prompts, prompt_real = left_pad(PROMPTS, pad_id=0)
    width = max(RESPONSE_LENGTHS)
    responses = torch.randint(1, 128, (len(PROMPTS), width), generator=torch.Generator().manual_seed(0))
    response_real = torch.arange(width)[None] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    return (
        torch.cat([prompts, responses * response_real], 1),
        torch.cat([prompt_real, response_real], 1),
        prompts.shape[1],
    )


def full_logits(model, input_ids, real, logits_from):
    document_ids, position_ids = ids_and_positions(real)
    return model(input_ids, position_ids=position_ids, document_ids=document_ids, logits_from=logits_from)


def scored(logits, input_ids, real, P) -> tuple[torch.Tensor, torch.Tensor]:
    """A GRPO-like loss over the real response tokens, and their log-probs."""
    width = input_ids.shape[1]
    logp, _ = logprobs_and_entropy(logits[:, : width - P], input_ids[:, P:], 1.0)
    mask = real[:, P:]
    weights = torch.linspace(-1.0, 1.0, mask.numel()).view_as(mask)
    return (logp * weights * mask).sum(), torch.where(mask, logp, 0.0)


def gradients(model, shared_prefix: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    input_ids, real, P = rows()
    model.zero_grad()
    if shared_prefix:
        logits = logits_with_shared_prefix(model, input_ids, real, len(SYSTEM), logits_from=P - 1)
    else:
        logits = full_logits(model, input_ids, real, P - 1)
    loss, logp = scored(logits, input_ids, real, P)
    loss.backward()
    wrappers = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing's and compile's
    names = {name: name.replace(wrappers[0], "").replace(wrappers[1], "") for name, _ in model.named_parameters()}
    return logp.detach(), {names[name]: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_prefix_run_once_gives_the_full_forwards_log_probs_and_gradients(checkpointing):
    """Prompts of four lengths (the prefix after different padding), responses of different lengths: the log-probs
    of every real response token and every parameter's gradient match the full rows' (GQA, RoPE positions)."""
    assert shared_prefix_length(PROMPTS) == len(SYSTEM)
    reference = tiny_model()
    reference_logp, reference_grads = gradients(reference, shared_prefix=False)
    model = tiny_model()
    apply_activation_checkpointing(model, checkpointing)
    logp, grads = gradients(model, shared_prefix=True)
    torch.testing.assert_close(logp, reference_logp, atol=1e-5, rtol=1e-5)
    assert reference_logp.abs().sum() > 0
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4)


def test_response_logprobs_runs_the_prefix_once_from_the_minimum_on():
    """``shared`` below ``SHARED_PREFIX_MIN`` scores the rows whole; from it on, the blocks see the prefix once (one
    extra row, in the same forward) and every row without it; the log-probs agree."""
    model = tiny_model()
    input_ids, real, P = rows()
    shapes: list[tuple[int, ...]] = []
    model.tok_embeddings.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        whole = response_logprobs(model, input_ids, real, P, 1.0, shared=4)[0]
        once = response_logprobs(model, input_ids, real, P, 1.0, shared=len(SYSTEM))[0]
    width = input_ids.shape[1]
    assert shapes == [(4, width), (5, width - len(SYSTEM))]  # the prefix (row 0, padded to the rows) and the rows
    mask = real[:, P:]
    torch.testing.assert_close(once[mask], whole[mask], atol=1e-5, rtol=1e-5)


def test_compiled_blocks_trace_the_shared_prefix_whole():
    """Compiled blocks (``fullgraph=True``, as ``trainer.parallel.apply_compile``) take the prefix row's stand-in KV
    cache without a graph break, and give the eager gradients."""
    eager_logp, eager_grads = gradients(tiny_model(), shared_prefix=True)
    model = tiny_model()
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        blocks[index] = torch.compile(block, fullgraph=True, backend="aot_eager")
    logp, grads = gradients(model, shared_prefix=True)
    torch.testing.assert_close(logp, eager_logp, atol=1e-6, rtol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5)


def shared_prefix_under_fsdp(rank: int, out_dir: str) -> None:
    """One rank of two: the full rows' gradients of a plain model against the prefix-once gradients of FSDP2-sharded,
    checkpointed blocks, gathered whole. (A prefix run in a forward of its own failed here: its block's weights were
    still sharded when the rows' gradient reached it through its keys, from outside the block's output.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    try:
        reference_logp, reference_grads = gradients(tiny_model(), shared_prefix=False)
        model = tiny_model()
        apply_activation_checkpointing(model, "full")
        apply_fsdp(model, init_device_mesh("cpu", (2,)))
        logp, grads = gradients(model, shared_prefix=True)
        torch.testing.assert_close(logp, reference_logp, atol=1e-5, rtol=1e-5)
        for name, grad in reference_grads.items():  # every rank scored the same rows: the mean is each rank's
            torch.testing.assert_close(grads[name].full_tensor(), grad, atol=1e-5, rtol=1e-4)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_checkpointed_blocks_give_the_full_rows_gradients(tmp_path):
    spawn_ranks(shared_prefix_under_fsdp, (str(tmp_path),), world=2, log_dir=tmp_path, timeout=600)
