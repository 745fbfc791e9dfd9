"""Full-sequence scoring passes over prompt + response rows under FlexAttention (issue 22): the rows are padded to
length buckets (``models.generation.flex_bucketed``), so the compiled flex kernel (``dynamic=False``: one graph per
sequence length) sees a few lengths over many rollouts of varying length, never reaches dynamo's recompile limit
(whose fallback is the unfused path that materialises the full score matrix), and the log-probs, values and rewards
are those of the unpadded rows. Without flex (SDPA: the CPU default) nothing is padded."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import models.model as model_module
from alignment.shared.responses import response_logprobs, response_values
from alignment.shared.rewards import RewardModelScore
from models import generation
from models.generation import flex_bucketed, left_pad
from models.heads import ScalarModel
from models.model import ModelConfig, Transformer
from tests.alignment.conftest import TINY

MAX_SEQ_LEN = 512
BUCKETS = MAX_SEQ_LEN // generation.FLEX_LENGTH_BUCKET


def rollouts(count: int = 20) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``count`` batches of 3 left-padded prompts + right-padded responses, every batch of another width (13 to 469)."""
    rng = torch.Generator().manual_seed(0)
    batches = []
    for index in range(count):
        prompts = [torch.randint(1, TINY["vocab_size"], (int(n),), generator=rng).tolist() for n in (5, 9, 12)]
        width = 1 + index * 24  # the longest response of the batch
        lengths = [width, max(1, width // 2), max(1, width - 7)]
        prompt_ids, prompt_real = left_pad(prompts, 0)
        responses = torch.randint(1, TINY["vocab_size"], (3, width), generator=rng)
        response_real = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
        batches.append(
            (
                torch.cat([prompt_ids, torch.where(response_real, responses, 0)], dim=1),
                torch.cat([prompt_real, response_real], dim=1),
                prompt_ids.shape[1],
            )
        )
    return batches


def models(attention: str) -> tuple[Transformer, ScalarModel, RewardModelScore]:
    torch.manual_seed(0)
    config = ModelConfig(**{**TINY, "max_seq_len": MAX_SEQ_LEN, "attention": attention})
    policy = Transformer(config).eval()
    critic = ScalarModel.from_backbone(Transformer(config)).eval()
    reward = RewardModelScore(ScalarModel.from_backbone(Transformer(config)), {"reward_mean": 0.1, "reward_std": 2.0}, "rm")  # fmt: skip
    return policy, critic, reward


@torch.no_grad()
def score(policy, critic, reward, batches) -> list[tuple[torch.Tensor, ...]]:
    results = []
    for input_ids, real, prompt_len in batches:
        logp, entropy = response_logprobs(policy, input_ids, real, prompt_len, 1.0)
        values = response_values(critic, input_ids, real, prompt_len)
        results.append((logp, entropy, values, reward(input_ids, real)))
    return results


@pytest.fixture()
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture()
def dynamo_warnings():
    """The warnings torch._dynamo logs (its logger does not propagate to the root, where caplog listens): the one
    that says a function hit the recompile limit and runs uncompiled from then on among them."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_twenty_rollouts_of_varying_length_compile_flex_once_per_bucket(
    backend, monkeypatch, dynamo_warnings, single_thread
):
    """The CUDA path (the flex kernel under torch.compile(dynamic=False)) forced on this CPU: 20 rollouts of 20
    widths from 13 to 469 tokens, scored by the policy, the critic and the reward model, compile the kernel at most
    once per bucket (128, 256, 384, 512), no recompile-limit warning, and every result equals the unpadded rows'
    (plain eager flex at the rows' own width) to 1e-5 in fp32. ``eager`` counts dynamo's compiles (one per distinct
    shape); ``inductor`` compiles the real fused kernel."""
    batches = rollouts()
    assert len({ids.shape[1] for ids, _, _ in batches}) == 20  # unpadded: 20 lengths, past the recompile limit of 8
    policy, critic, reward = models("flex")
    with monkeypatch.context() as unpadded:
        unpadded.setattr(generation, "FLEX_LENGTH_BUCKET", 1)  # no padding: the plain (eager) flex kernel
        expected = score(policy, critic, reward, batches)

    compiles: list[int] = []

    def counting_backend(graph, example_inputs):
        compiles.append(len(example_inputs))
        if backend == "eager":
            return graph.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph, example_inputs)

    compiled_flex = torch.compile(flex_attention, dynamic=False, backend=counting_backend)
    lengths: list[int] = []

    def kernel(q, k, v, block_mask, enable_gqa, scale=None):
        lengths.append(q.shape[2])
        return compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, scale=scale)

    monkeypatch.setattr(model_module, "flex_attention_kernel", kernel)
    results = score(policy, critic, reward, batches)
    assert set(lengths) <= {128, 256, 384, 512} and len(set(lengths)) == BUCKETS
    assert 1 <= len(compiles) <= BUCKETS, compiles
    assert not [message for message in dynamo_warnings if "recompile_limit" in message]
    for got, want in zip(results, expected):
        for name, a, b in zip(("logp", "entropy", "values", "reward"), got, want):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_without_flex_nothing_is_padded():
    """SDPA (the CPU default, and attention=sdpa anywhere): the rows reach the model as they are, so CPU numbers
    are what they were."""
    policy, _, _ = models("auto")
    input_ids, real, _ = rollouts(2)[1]
    padded_ids, padded_real = flex_bucketed(policy.config, input_ids, real)
    assert padded_ids is input_ids and padded_real is real
    flex = ModelConfig(**{**TINY, "max_seq_len": MAX_SEQ_LEN, "attention": "flex"})
    padded_ids, padded_real = flex_bucketed(flex, input_ids, real)
    assert padded_ids.shape[1] == 128 and torch.equal(padded_ids[:, : input_ids.shape[1]], input_ids)
    assert not padded_real[:, input_ids.shape[1] :].any()
    capped = ModelConfig(**{**TINY, "max_seq_len": 40, "attention": "flex"})
    assert flex_bucketed(capped, input_ids, real)[0].shape[1] == 40  # capped at max_seq_len
