"""Prompts that extend the last call's (a multi-turn episode's next turn) prefill only their new tokens from the keys
and values ``PrefixCache`` kept: the tokens and log-probs are those of a full prefill and of recomputation."""

from __future__ import annotations

import pytest
import torch

from models.generation import generate
from models.prefix_cache import PrefixCache
from tests.models.test_generation import PROMPTS, VARIANTS, tiny_model


def next_turn(first: list[list[int]], out, observations: list[list[int]]) -> list[list[int]]:
    """Each row's prompt, its sampled tokens and an observation after them."""
    return [p + out.tokens[i][out.mask[i]].tolist() + observations[i] for i, p in enumerate(first)]


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_turn_that_extends_the_last_prefills_only_its_new_tokens_and_decodes_as_a_full_prefill(decode, temperature):
    """Two turns of three rows of different lengths, then a third call where one row is new: each row's second-turn
    tokens and log-probs equal those of the same prompts prefilled whole, and of recomputation (greedy); the cache
    reused exactly the first turn's prompt tokens."""
    model = tiny_model()
    settings = {"max_new_tokens": 6, "temperature": temperature, "decode": decode}
    cache = PrefixCache()
    first = generate(model, PROMPTS, **settings, generator=torch.Generator().manual_seed(0), prefix_cache=cache)
    assert cache.reused_tokens == 0 and cache.prefilled_tokens == sum(len(p) for p in PROMPTS)
    second = next_turn(PROMPTS, first, [[9, 10, 11], [12], [13, 14, 15, 16, 17]])
    kept = generate(model, second, **settings, generator=torch.Generator().manual_seed(1), prefix_cache=cache)
    whole = generate(model, second, **settings, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kept.tokens, whole.tokens) and torch.equal(kept.mask, whole.mask)
    torch.testing.assert_close(kept.logprobs, whole.logprobs, atol=1e-5, rtol=0)
    assert cache.reused_tokens == sum(len(p) for p in PROMPTS)
    if temperature == 0.0:
        recomputed = generate(model, second, **{**settings, "decode": "eager"}, use_cache=False)
        assert torch.equal(kept.tokens, recomputed.tokens)

    third = [*next_turn(second, kept, [[20], [21, 22], [23]])[:2], [30, 31, 32]]  # the last row starts afresh
    before = cache.reused_tokens
    kept = generate(model, third, **settings, generator=torch.Generator().manual_seed(2), prefix_cache=cache)
    whole = generate(model, third, **settings, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kept.tokens, whole.tokens)
    torch.testing.assert_close(kept.logprobs, whole.logprobs, atol=1e-5, rtol=0)
    assert cache.reused_tokens - before == len(second[0]) + len(second[1])


def test_rows_that_stop_leave_the_batch_as_after_a_whole_prefill():
    """Static decoding past its stop check (8 tokens), rows stopping at different steps and leaving the batch (their
    holes copied with them): the tokens and log-probs are those of a whole prefill."""
    model = tiny_model()
    settings = {"max_new_tokens": 12, "temperature": 1.0, "decode": "static", "stop_ids": list(range(0, 128, 9))}
    cache = PrefixCache()
    prompts = [*PROMPTS, [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]
    first = generate(model, prompts, **settings, generator=torch.Generator().manual_seed(0), prefix_cache=cache)
    assert 0 < int(first.mask.sum(1).min()) < 12  # a row stopped early
    second = next_turn(prompts, first, [[9, 10, 11], [12], [13, 14, 15, 16, 17], [18, 19]])
    kept = generate(model, second, **settings, generator=torch.Generator().manual_seed(1), prefix_cache=cache)
    assert cache.reused_tokens == sum(len(p) for p in prompts)
    whole = generate(model, second, **settings, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kept.tokens, whole.tokens) and torch.equal(kept.mask, whole.mask)
    torch.testing.assert_close(kept.logprobs, whole.logprobs, atol=1e-5, rtol=0)


def test_a_sliding_window_model_prefills_whole():
    """A sliding-window layer measures distance in cache indices, which the kept layout's holes would stretch: such a
    model keeps nothing and prefills every turn whole, with the same tokens."""
    model = tiny_model(**VARIANTS["gemma3-block+window"])
    cache = PrefixCache()
    first = generate(model, PROMPTS, max_new_tokens=4, temperature=0.0, prefix_cache=cache)
    second = next_turn(PROMPTS, first, [[9], [10], [11]])
    kept = generate(model, second, max_new_tokens=4, temperature=0.0, prefix_cache=cache)
    assert cache.reused_tokens == 0 and not cache.kept
    assert torch.equal(kept.tokens, generate(model, second, max_new_tokens=4, temperature=0.0).tokens)


def test_a_layout_past_the_context_prefills_whole():
    """Kept prefixes, the new tokens' block and the tokens to generate must fit the context; else the call prefills
    as usual (and keeps its prompts for the next)."""
    model = tiny_model()  # max_seq_len 128
    cache = PrefixCache()
    first = generate(model, [[1] * 100, [2, 3]], max_new_tokens=2, temperature=0.0, prefix_cache=cache)
    second = next_turn([[1] * 100, [2, 3]], first, [[4], [5] * 60])  # holes: 100 kept + 62 new > 128
    kept = generate(model, second, max_new_tokens=2, temperature=0.0, prefix_cache=cache)
    assert cache.reused_tokens == 0 and len(cache.kept) == 2
    assert torch.equal(kept.tokens, generate(model, second, max_new_tokens=2, temperature=0.0).tokens)
