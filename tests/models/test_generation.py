"""Generation: KV cache vs recomputation, left padding, log-prob semantics, stopping, sampling filters, errors."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from models.generation import generate, left_pad, sequence_logprobs
from models.model import ModelConfig, RopeScaling, Transformer
from models.sampling import GenerationOutput, filter_logits, pick_next, sample_next
from tests.helpers import family_block

VARIANTS = {
    "base": {},
    # Qwen3's block (QK norm, heads wider than dim / n_heads, tied embeddings) under Llama 3.1 RoPE scaling, its
    # original_max_position_embeddings small enough that the scaling changes frequencies our positions reach.
    "qwen3-block+rope_scaling": {
        "rope_scaling": RopeScaling(factor=8.0, original_max_position_embeddings=32),
        "qk_norm": True,
        "head_dim_override": 32,
        "tie_embeddings": True,
        "hf_architecture": "Qwen3ForCausalLM",
    },
    # Gemma 3's block with a local layer whose window (4) every prompt and generation here outgrows, then a global one
    "gemma3-block+window": {
        **family_block("Gemma3ForCausalLM"),
        "attention_scale_dim": 20.0,
        "sliding_window": 4,
        "sliding_window_pattern": 2,
        "rope_local_theta": 10000.0,
        "tie_embeddings": True,
    },
}

PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7, 2], [100, 1, 64, 33]]  # different lengths: rows 1 and 2 get left-padded


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=128, **overrides
    )
    model = Transformer(config)
    # The default std 0.02 gives near-uniform next-token distributions, where greedy could flip on a 1e-7
    # numerical difference. Larger weights give peaked, more LM-like distributions and stable argmaxes.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """The tiny model's ops are too small to gain from intra-op threads; one thread avoids the sync overhead
    (and thrashing when other processes share the 2 CPU cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request) -> Transformer:
    return tiny_model(**VARIANTS[request.param])


@pytest.fixture(scope="module")
def base_model() -> Transformer:
    return tiny_model()


def full_sequence(
    prompts: list[list[int]], out: GenerationOutput, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt + generated tokens, and the real-token mask over both."""
    prompt_ids, prompt_real = left_pad(prompts, pad_id)
    return torch.cat([prompt_ids, out.tokens], dim=1), torch.cat([prompt_real, out.mask], dim=1)


def test_greedy_cache_matches_recompute(model):
    cached = generate(model, PROMPTS, max_new_tokens=24, temperature=0)
    recomputed = generate(model, PROMPTS, max_new_tokens=24, temperature=0, use_cache=False)
    assert cached.tokens.shape == (len(PROMPTS), 24)
    assert torch.equal(cached.tokens, recomputed.tokens)
    assert cached.mask.all() and torch.equal(cached.lengths, torch.full((len(PROMPTS),), 24))
    torch.testing.assert_close(cached.logprobs, recomputed.logprobs, atol=1e-5, rtol=0)


def test_sampling_cache_matches_recompute(model):
    kwargs = dict(max_new_tokens=16, temperature=0.8, top_k=50, top_p=0.95)
    cached = generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), **kwargs)
    recomputed = generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), use_cache=False, **kwargs)
    assert torch.equal(cached.tokens, recomputed.tokens)
    torch.testing.assert_close(cached.logprobs, recomputed.logprobs, atol=1e-5, rtol=0)


def test_left_padded_batch_matches_single_prompts(model):
    batched = generate(model, PROMPTS, max_new_tokens=20, temperature=0)
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], max_new_tokens=20, temperature=0)
        assert torch.equal(batched.tokens[row], alone.tokens[0]), f"row {row} differs from its prompt run alone"
        torch.testing.assert_close(batched.logprobs[row], alone.logprobs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=0.7, top_k=20, top_p=0.8)],
    ids=["greedy", "t0.7", "t0.7-topk-topp"],
)
def test_logprobs_match_fresh_forward(model, sampling):
    """Returned log-probs == a training-style forward over prompt + generation (pre-filter, same temperature)."""
    out = generate(model, PROMPTS, max_new_tokens=16, generator=torch.Generator().manual_seed(0), **sampling)
    input_ids, real = full_sequence(PROMPTS, out)
    width = input_ids.shape[1] - out.tokens.shape[1]
    recomputed = sequence_logprobs(model, input_ids, real_mask=real, temperature=sampling["temperature"])
    assert recomputed.shape == (len(PROMPTS), input_ids.shape[1] - 1)
    # The logit at position t scores token t+1, so generated token j is scored at column width - 1 + j.
    recomputed = recomputed[:, width - 1 :]
    torch.testing.assert_close(recomputed[out.mask], out.logprobs[out.mask], atol=1e-5, rtol=0)
    assert (out.logprobs <= 0).all()


def test_logprobs_with_stops_match_fresh_forward(base_model):
    """Rows that stopped early (trailing pads) still score correctly in a fresh forward."""
    free = generate(base_model, PROMPTS, max_new_tokens=12, temperature=0)
    stop_id = int(free.tokens[0, 4])
    out = generate(base_model, PROMPTS, max_new_tokens=12, temperature=0, stop_ids=[stop_id])
    assert not out.mask.all()  # the stop really happened
    input_ids, real = full_sequence(PROMPTS, out)
    width = input_ids.shape[1] - out.tokens.shape[1]
    recomputed = sequence_logprobs(base_model, input_ids, real_mask=real, temperature=0)[:, width - 1 :]
    torch.testing.assert_close(recomputed[out.mask], out.logprobs[out.mask], atol=1e-5, rtol=0)


def test_per_row_stop(base_model):
    steps = 16
    free = generate(base_model, PROMPTS, max_new_tokens=steps, temperature=0)
    # A stop id that row 0 emits first at step k and that row 1 never emits: row 0 stops, row 1 runs to the end.
    row0, row1 = free.tokens[0].tolist(), set(free.tokens[1].tolist())
    k = next(k for k in range(2, steps - 2) if row0[k] not in row0[:k] and row0[k] not in row1)
    stop_id = row0[k]
    pad_id = 127
    out = generate(base_model, PROMPTS, max_new_tokens=steps, temperature=0, stop_ids=[stop_id], pad_id=pad_id)

    assert out.tokens.shape == (len(PROMPTS), steps)  # row 1 kept the loop going
    assert out.tokens[0, : k + 1].tolist() == row0[: k + 1]  # the stop token itself is kept...
    assert out.mask[0, : k + 1].all()  # ...and is real
    assert not out.mask[0, k + 1 :].any()
    assert (out.tokens[0, k + 1 :] == pad_id).all()
    assert (out.logprobs[0, k + 1 :] == 0).all()
    assert out.lengths[0] == k + 1
    assert torch.equal(out.tokens[1], free.tokens[1]) and out.mask[1].all() and out.lengths[1] == steps


def test_loop_ends_when_every_row_stopped(base_model):
    free = generate(base_model, PROMPTS, max_new_tokens=10, temperature=0)
    out = generate(base_model, PROMPTS, max_new_tokens=10, temperature=0, stop_ids=free.tokens[:, 1].tolist())
    last_stop = max(int(out.lengths.max()), 1)
    assert out.tokens.shape[1] == last_stop <= 2
    assert torch.equal(out.lengths, out.mask.sum(dim=1))


def test_top_k_1_equals_greedy(model):
    greedy = generate(model, PROMPTS, max_new_tokens=12, temperature=0)
    top1 = generate(
        model, PROMPTS, max_new_tokens=12, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(top1.tokens, greedy.tokens)


def test_filter_logits_hand_made():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])  # sorted: 0.5 (id 1), 0.3 (id 3), 0.15 (id 0), 0.05 (id 2)
    logits = probs.log()

    def kept(**kwargs) -> set[int]:
        return set(torch.isfinite(filter_logits(logits, **kwargs))[0].nonzero().flatten().tolist())

    assert kept(top_p=0.75) == {1, 3}  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75
    assert kept(top_p=0.85) == {0, 1, 3}
    assert kept(top_p=0.97) == {0, 1, 2, 3}
    assert kept(top_p=1.0) == {0, 1, 2, 3}
    assert kept(top_p=0.1) == {1}  # the top-1 is always kept
    assert kept(top_k=1) == {1}
    assert kept(top_k=2) == {1, 3}
    assert kept(top_k=10) == {0, 1, 2, 3}
    # top-k first, then top-p over the renormalised survivors: 0.5/0.95 = 0.53 < 0.6 -> the second stays too.
    assert kept(top_k=3, top_p=0.6) == {1, 3}
    # Kept logits are unchanged (filtering only removes).
    filtered = filter_logits(logits, top_p=0.75)
    assert torch.equal(filtered[0, [1, 3]], logits[0, [1, 3]])


def test_sampling_stays_in_nucleus_and_reports_unfiltered_logprob():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log().expand(2000, 4)
    tokens, logprobs = sample_next(logits, 1.0, None, 0.75, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {1, 3}
    # Log-prob is from the unfiltered distribution, not the renormalised nucleus.
    torch.testing.assert_close(logprobs, logits[0].log_softmax(-1)[tokens])
    # Frequencies follow the renormalised nucleus: 0.5 / 0.8 = 0.625.
    assert abs((tokens == 1).float().mean().item() - 0.625) < 0.05


def test_a_draw_picks_by_cumulative_probability_and_never_a_filtered_token():
    """One uniform per row picks the token where the cumulative probability passes it: the lowest and highest draws
    land on the first and last token that can be sampled, never on one of probability 0 beside them."""
    logits = torch.tensor([[float("-inf"), float("-inf"), 0.0, 0.0, float("-inf"), 0.0, float("-inf")]]).expand(4, 7)
    draws = torch.tensor([[0.0], [0.3], [0.5], [torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)).item()]], dtype=torch.float64)  # fmt: skip
    tokens, _ = pick_next(logits, 1.0, None, None, draws)
    assert tokens.tolist() == [2, 2, 3, 5]


def test_sampling_follows_a_wide_distribution():
    """Over a vocabulary of SmolLM2's size whose mass is mostly in a long tail, the sampled frequencies match the
    probabilities (within 4 standard errors): head, tail and the empty middle."""
    vocab = 49152
    probs = torch.zeros(vocab, dtype=torch.float64)
    probs[0], probs[1000:] = 0.2, 0.8 / (vocab - 1000)
    logits = probs.log().float().expand(2000, vocab)
    tokens, _ = sample_next(logits, 1.0, None, None, torch.Generator().manual_seed(0))
    head = (tokens == 0).double().mean().item()
    assert abs(head - 0.2) < 4 * (0.2 * 0.8 / 2000) ** 0.5
    assert not ((tokens > 0) & (tokens < 1000)).any()
    tail = tokens[tokens >= 1000].double()
    assert abs(tail.mean().item() - (1000 + vocab - 1) / 2) < 4 * ((vocab - 1000) / 12**0.5) / len(tail) ** 0.5


SYSTEM = [9, 4, 77, 12, 3, 58, 21, 90, 6, 31]  # a prefix every prompt shares, as a chat template's system turn


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_prefix_the_batch_shares_runs_once_and_decodes_the_same(base_model, decode, monkeypatch):
    """Prompts of three lengths (so the shared prefix sits after different padding) decode with the prefix run
    once exactly as with every row prefilled in full: the same greedy tokens, the same sampled tokens and
    log-probs from the same generator; the prefix's keys and values are computed once."""
    from models import prefill

    prompts = [SYSTEM + [5, 17, 99], SYSTEM + [7], SYSTEM + [100, 1, 64, 33, 2], SYSTEM + [7]]
    assert prefill.shared_prefix_length(prompts) == len(SYSTEM)
    runs = {}
    for shared in (True, False):
        monkeypatch.setattr(prefill, "SHARED_PREFIX_MIN", 8 if shared else 10**9)
        calls = []  # the token shapes each forward embeds
        hook = base_model.tok_embeddings.register_forward_hook(lambda module, args, out, seen=calls: seen.append(tuple(args[0].shape)))  # fmt: skip
        greedy = generate(base_model, prompts, max_new_tokens=8, temperature=0, decode=decode)
        sampled = generate(base_model, prompts, max_new_tokens=8, temperature=1.0, decode=decode, generator=torch.Generator().manual_seed(3))  # fmt: skip
        hook.remove()
        runs[shared] = greedy, sampled, calls
    (greedy, sampled, calls), (full_greedy, full_sampled, full_calls) = runs[True], runs[False]
    assert torch.equal(greedy.tokens, full_greedy.tokens) and torch.equal(sampled.tokens, full_sampled.tokens)
    torch.testing.assert_close(sampled.logprobs, full_sampled.logprobs, atol=1e-5, rtol=1e-5)
    # the prefill's forwards: the prefix alone (1 row), then the rest of every row; in full, every row whole
    assert calls[:2] == [(1, len(SYSTEM)), (4, 5)] and full_calls[0] == (4, len(SYSTEM) + 5)
    assert prefill.shared_prefix_length([[1, 2, 3], [1, 2]]) == 1  # each row keeps its last token to prefill


def test_sampling_reproducible_with_seeded_generator(base_model):
    kwargs = dict(max_new_tokens=12, temperature=1.0, top_p=0.9)
    first = generate(base_model, PROMPTS, generator=torch.Generator().manual_seed(7), **kwargs)
    second = generate(base_model, PROMPTS, generator=torch.Generator().manual_seed(7), **kwargs)
    other = generate(base_model, PROMPTS, generator=torch.Generator().manual_seed(8), **kwargs)
    assert torch.equal(first.tokens, second.tokens)
    assert torch.equal(first.logprobs, second.logprobs)
    assert not torch.equal(first.tokens, other.tokens)


def test_tensor_prompts_and_outputs_usable_in_autograd(base_model):
    prompts = torch.tensor([[3, 4, 5], [6, 7, 8]])
    out = generate(base_model, prompts, max_new_tokens=5, temperature=0)
    assert torch.equal(out.tokens, generate(base_model, prompts.tolist(), max_new_tokens=5, temperature=0).tokens)
    assert out.tokens.dtype == torch.long and out.mask.dtype == torch.bool and out.logprobs.dtype == torch.float32
    assert out.lengths.dtype == torch.long
    # Not inference tensors: PPO may save them for backward.
    assert not any(t.is_inference() for t in (out.tokens, out.mask, out.logprobs, out.lengths))
    weight = torch.ones((), requires_grad=True)
    (weight * out.logprobs).sum().backward()


def test_prompt_filling_max_seq_len_exactly(base_model):
    max_len = base_model.config.max_seq_len
    out = generate(base_model, [[1] * (max_len - 4), [2, 3]], max_new_tokens=4, temperature=0)
    assert out.tokens.shape == (2, 4)


def test_errors(base_model):
    max_len, vocab = base_model.config.max_seq_len, base_model.config.vocab_size
    with pytest.raises(ValueError, match=f"prompt of 120 tokens \\+ max_new_tokens 9 exceeds max_seq_len {max_len}"):
        generate(base_model, [[1] * 120, [2]], max_new_tokens=9)
    with pytest.raises(ValueError, match=f"prompt of {max_len + 1} tokens \\+ max_new_tokens 1 exceeds max_seq_len"):
        generate(base_model, [[1] * (max_len + 1)], max_new_tokens=1)
    with pytest.raises(ValueError, match=f"token id {vocab}"):
        generate(base_model, [[1, 2], [3, vocab]], max_new_tokens=2)
    with pytest.raises(ValueError, match="token id -1"):
        generate(base_model, [[-1]], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(base_model, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(base_model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="integer token ids"):
        generate(base_model, [[1.5]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(base_model, [[1]], max_new_tokens=0)
    for bad in (dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            generate(base_model, [[1]], max_new_tokens=2, **bad)
    with pytest.raises(ValueError, match=f"stop/pad id {vocab}"):
        generate(base_model, [[1]], max_new_tokens=2, stop_ids=[vocab])


@pytest.mark.parametrize("training", [True, False])
def test_training_mode_restored(base_model, training):
    base_model.train(training)
    seen = []
    hook = base_model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(module.training))
    try:
        generate(base_model, [[1, 2]], max_new_tokens=3, temperature=0.5)
    finally:
        hook.remove()
    assert seen and not any(seen)  # generation ran in eval mode
    assert base_model.training is training
    assert all(m.training is training for m in base_model.modules())
    base_model.eval()


# ---- static KV cache / compiled decode step (models/fast_decode.py) ----


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_cache_matches_eager_and_recompute(model, temperature):
    """Reading the whole fixed-size cache under a mask gives the eager path's tokens, log-probs included.
    Called twice: the second call reuses the buffers (stale keys/values from the first must stay hidden)."""

    def run(**kwargs):
        return generate(
            model,
            PROMPTS,
            max_new_tokens=12,
            temperature=temperature,
            generator=torch.Generator().manual_seed(3),
            **kwargs,
        )

    reference = run(use_cache=False)
    eager = run()
    for _ in range(2):
        static = run(static_cache=True)
        assert torch.equal(static.tokens, reference.tokens) and torch.equal(static.tokens, eager.tokens)
        assert torch.equal(static.mask, eager.mask)
        torch.testing.assert_close(static.logprobs, eager.logprobs, atol=1e-5, rtol=0)


def test_static_cache_reused_across_prompt_widths(base_model):
    """Different prompt widths fall in one length bucket and reuse one cache; every call still matches."""
    for prompts in (PROMPTS, [[9, 8, 7]], [[1] * 30, [2, 3]]):
        reference = generate(base_model, prompts, max_new_tokens=8, temperature=0, use_cache=False)
        static = generate(base_model, prompts, max_new_tokens=8, temperature=0, static_cache=True)
        assert torch.equal(static.tokens, reference.tokens)


@pytest.mark.slow
def test_compiled_decode_step_matches_recompute_on_cpu(base_model):
    """torch.compile of the decode step (inductor on CPU; CUDA graphs only on CUDA) changes no token: greedy equals
    recomputation and eager decoding, and sampling (inside the step, from the generator's own draws) gives the
    eager tokens from the same seed, stops included."""
    reference = generate(base_model, PROMPTS, max_new_tokens=10, temperature=0, use_cache=False)
    for _ in range(2):  # the second call replays the compiled step
        compiled = generate(base_model, PROMPTS, max_new_tokens=10, temperature=0, compile=True)
        assert torch.equal(compiled.tokens, reference.tokens)
        assert torch.equal(generate(base_model, PROMPTS, max_new_tokens=10, temperature=0, decode="compiled").tokens, reference.tokens)  # fmt: skip
    stops = stop_ids_from(base_model)
    for temperature in (0.0, 1.0):
        eager, compiled = (
            generate(
                base_model, PROMPTS, max_new_tokens=20, temperature=temperature, stop_ids=stops, decode=decode,
                generator=torch.Generator().manual_seed(5),
            )
            for decode in ("eager", "compiled")
        )  # fmt: skip
        assert torch.equal(compiled.tokens, eager.tokens) and torch.equal(compiled.mask, eager.mask)
        torch.testing.assert_close(compiled.logprobs, eager.logprobs, atol=1e-5, rtol=0)


def test_the_compiled_decode_step_mutates_only_static_buffers_and_compiles_once(base_model, monkeypatch):
    """What CUDA graphs need of the step, checked on CPU in AOTAutograd's record of the traced step (the graph
    inductor compiles): one whole graph (fullgraph), compiled once over 200 steps of changing batch contents, and
    every input it writes (the KV cache, the cached document ids) a static buffer at a fixed address, so that
    cudagraph trees capture it instead of skipping it for "mutated inputs". A cache an uncompiled decode made first
    is marked too (it was not: the static-then-compiled benchmark reused it unmarked)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext

    from models import fast_decode

    graphs: list[tuple[list[int], set[int]]] = []

    def forward_compiler(graph, example_inputs):
        meta = TracingContext.get().fw_metadata
        written = [i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata]
        graphs.append((written, set(meta.static_input_indices)))
        return graph

    step = torch.compile(
        fast_decode.decode_and_sample, backend=aot_autograd(fw_compiler=forward_compiler), fullgraph=True
    )
    monkeypatch.setattr(fast_decode, "compiled", lambda function: step)
    marked = fast_decode.static_cache  # the CUDA setting (on CPU the step runs without graphs, and marks nothing)
    monkeypatch.setattr(fast_decode, "static_cache", lambda *args, mark_static: marked(*args, mark_static=True))
    generate(base_model, PROMPTS, max_new_tokens=8, temperature=1.0, decode="static")  # the cache, made unmarked
    for seed in range(2):  # other prompts of the same widths: other tokens, the same shapes
        prompts = [[(token * (seed + 3)) % 120 + 1 for token in prompt] for prompt in PROMPTS]
        out = generate(base_model, prompts, max_new_tokens=101, temperature=1.0, decode="compiled",
                       generator=torch.Generator().manual_seed(seed))  # fmt: skip
        assert out.tokens.shape[1] == 101
    assert len(graphs) == 1, f"{len(graphs)} compilations: the step recompiled"
    written, static = graphs[0]
    assert written, "the step writes the KV cache: its record must say so"
    assert set(written) <= static, f"inputs {sorted(set(written) - static)} are written but not static buffers"


@pytest.mark.slow
def test_compiled_decode_past_the_recompile_limit_runs_uncompiled(base_model, monkeypatch):
    """fullgraph=True fails a call at dynamo's recompile limit; the compiled decode step then runs that variant
    uncompiled (one warning) and gives the same tokens."""
    greedy = generate(base_model, PROMPTS, max_new_tokens=6, temperature=0, decode="eager")
    generate(base_model, PROMPTS, max_new_tokens=6, temperature=0, decode="compiled")  # a compiled variant
    from models import fast_decode

    monkeypatch.setattr(fast_decode, "_over_limit", set())
    sample = functools.partial(generate, base_model, PROMPTS, max_new_tokens=6, temperature=0.7)  # a new variant
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(UserWarning, match="recompile limit"):
        sampled = sample(decode="compiled", generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled.tokens, sample(decode="eager", generator=torch.Generator().manual_seed(0)).tokens)
    assert torch.equal(generate(base_model, PROMPTS, max_new_tokens=6, temperature=0, decode="compiled").tokens, greedy.tokens)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
def test_static_and_compiled_decoding_on_cuda(compile):
    """On CUDA: greedy static(+CUDA-graph) decoding equals recomputation in fp32, and sampling takes a CUDA
    generator (a CPU one cannot draw on the GPU)."""
    model = tiny_model().cuda()
    reference = generate(model, PROMPTS, max_new_tokens=10, temperature=0, use_cache=False)
    for _ in range(2):
        fast = generate(model, PROMPTS, max_new_tokens=10, temperature=0, static_cache=True, compile=compile)
        assert fast.tokens.is_cuda and torch.equal(fast.tokens, reference.tokens)
    sampled = [
        generate(
            model,
            PROMPTS,
            max_new_tokens=10,
            temperature=1.0,
            generator=torch.Generator("cuda").manual_seed(0),
            compile=compile,
        ).tokens
        for _ in range(2)
    ]
    assert torch.equal(*sampled)


def stop_ids_from(model) -> list[int]:
    """Stop ids that end greedy rows at different steps: row 0's 3rd token and row 2's 12th (row 1 runs on)."""
    greedy = generate(model, PROMPTS, max_new_tokens=14, temperature=0)
    return [int(greedy.tokens[0, 2]), int(greedy.tokens[2, 11])]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_new_tokens", [3, 9, 20])
def test_static_decode_with_stops_equals_eager(base_model, temperature, max_new_tokens):
    """The static step samples, scores and tracks stops itself and the loop asks whether every row stopped only every
    STOP_CHECK_EVERY tokens: the tokens decoded after the last row stopped are cut, so the output (length
    included) is the eager loop's, which checks after every token; sampled tokens come from the same draws."""
    stops = stop_ids_from(base_model)
    for prompts in (PROMPTS, PROMPTS[:1]):  # one row stops at its 3rd token: everything after it is cut
        eager, static = (
            generate(
                base_model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=stops,
                decode=decode, generator=torch.Generator().manual_seed(1),
            )
            for decode in ("eager", "static")
        )  # fmt: skip
        assert torch.equal(static.tokens, eager.tokens) and torch.equal(static.mask, eager.mask)
        assert torch.equal(static.lengths, eager.lengths)
        torch.testing.assert_close(static.logprobs, eager.logprobs, atol=1e-5, rtol=0)
    # the trim at work: a row that stopped before the first check still ends at its stop
    assert generate(base_model, PROMPTS[:1], max_new_tokens=20, temperature=0, stop_ids=stops, decode="static").tokens.shape[1] <= 3  # fmt: skip


MANY_PROMPTS = [[(7 * i + j) % 120 + 1 for j in range(2 + i % 5)] for i in range(12)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("use_cache", [True, False], ids=["eager", "recompute"])
def test_stopped_rows_leave_the_batch_and_every_row_decodes_as_in_the_full_batch(
    model, temperature, use_cache, monkeypatch
):
    """Rows that stopped leave the eager batch (the KV cache keeps the rows still decoding) in several rounds;
    every row's tokens, mask and lengths equal those of the full batch, its log-probs to rounding, and a sampled
    row takes the same draws of the generator (one per row of the original batch each step)."""
    import models.generation as generation
    from models.attention import KVCache

    greedy = generate(model, MANY_PROMPTS, max_new_tokens=20, temperature=0)
    stops = sorted({int(greedy.tokens[row, 1 + row]) for row in range(0, 12, 2)})  # rows stop at different steps
    kept: list[int] = []
    keep_rows = KVCache.keep_rows
    monkeypatch.setattr(KVCache, "keep_rows", lambda cache, rows: (kept.append(len(rows)), keep_rows(cache, rows)))

    def run(compact_when: int):
        monkeypatch.setattr(generation, "COMPACT_WHEN_STOPPED", compact_when)
        return generate(
            model, MANY_PROMPTS, max_new_tokens=20, temperature=temperature, top_k=40, stop_ids=stops,
            use_cache=use_cache, generator=torch.Generator().manual_seed(5),
            stop_when=lambda tokens: (tokens == 77).any(dim=1),
        )  # fmt: skip

    full = run(0)  # 0: no row ever leaves
    assert kept == []
    compacted = run(10**6)  # a row leaves as soon as it stops
    assert torch.equal(compacted.tokens, full.tokens) and torch.equal(compacted.mask, full.mask)
    assert torch.equal(compacted.lengths, full.lengths)
    torch.testing.assert_close(compacted.logprobs, full.logprobs, atol=1e-5, rtol=0)
    lengths = sorted(set(full.lengths.tolist()))
    assert len(lengths) >= 3 and full.lengths.max() > full.lengths.min()  # rows did stop at different steps
    if use_cache:
        assert len(kept) >= 2 and kept == sorted(kept, reverse=True)  # left in rounds, the batch shrinking


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_decode_moves_the_rows_still_decoding_into_smaller_batches(model, temperature, monkeypatch):
    """At the stop checks, the rows still decoding move into the reused cache of a batch of the next power of two
    (12 rows: 16 -> 8 -> 4 ...); every row's output equals that of the full batch and of the eager loop."""
    import models.fast_decode as fast_decode

    greedy = generate(model, MANY_PROMPTS, max_new_tokens=40, temperature=0)
    stops = sorted({int(greedy.tokens[row, 3 * row]) for row in range(1, 12)})  # rows stop at different steps
    sizes: list[int] = []
    move = fast_decode._without_stopped_rows
    monkeypatch.setattr(
        fast_decode, "_without_stopped_rows", lambda *args, **kwargs: (out := move(*args, **kwargs), sizes.append(len(out[3])))[0]
    )  # fmt: skip

    def run(decode: str):
        return generate(
            model, MANY_PROMPTS, max_new_tokens=40, temperature=temperature, top_k=40, stop_ids=stops, decode=decode,
            generator=torch.Generator().manual_seed(5),
        )  # fmt: skip

    eager, static = run("eager"), run("static")
    assert sizes and sizes == sorted(sizes, reverse=True) and all(size & (size - 1) == 0 for size in sizes)
    assert torch.equal(static.tokens, eager.tokens) and torch.equal(static.mask, eager.mask)
    assert torch.equal(static.lengths, eager.lengths) and len(set(eager.lengths.tolist())) >= 3
    torch.testing.assert_close(static.logprobs, eager.logprobs, atol=1e-5, rtol=0)


class HostSyncs:
    """Counts the calls that make the host wait for the device: a tensor read as a Python bool, int or float."""

    NAMES = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("decode", ["static", pytest.param("compiled", marks=pytest.mark.slow)])
def test_static_decode_syncs_with_the_host_once_per_k_tokens(base_model, decode, monkeypatch):
    """Eager decoding asks ``bool(done.all())`` after every token; the static step at most once per
    STOP_CHECK_EVERY tokens (the last one included: the length of the output)."""
    from models.fast_decode import STOP_CHECK_EVERY

    tokens = 4 * STOP_CHECK_EVERY
    run = functools.partial(generate, base_model, PROMPTS, max_new_tokens=tokens, temperature=1.0, stop_ids=[])
    run(decode=decode)  # the compiled step is traced first: tracing is not decoding
    syncs = HostSyncs(monkeypatch)
    out = run(decode=decode, generator=torch.Generator().manual_seed(0))
    assert out.tokens.shape[1] == tokens
    assert syncs.count <= tokens / STOP_CHECK_EVERY, syncs.count
    syncs.count = 0
    run(decode="eager")
    assert syncs.count >= tokens - 1  # what it was


def test_auto_decode_is_eager_on_cpu_and_compiled_on_cuda(base_model, monkeypatch):
    """decode="auto" (every caller's default) resolves by device: eager on the CPU, where it is fastest and where
    every CPU number stays what it was; the compiled static decode on CUDA."""
    from models import fast_decode
    from models.generation import resolve_decode

    assert resolve_decode("auto", "cpu") == "eager" and resolve_decode("auto", torch.device("cuda", 0)) == "compiled"
    assert resolve_decode("static", "cpu") == "static"
    with pytest.raises(ValueError, match="decode must be one of"):
        resolve_decode("fast", "cpu")

    def no_static_path(*args, **kwargs):
        raise AssertionError("decode=auto took the static path on the CPU")

    eager = generate(base_model, PROMPTS, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(2), decode="eager")  # fmt: skip
    monkeypatch.setattr(fast_decode, "static_cache", no_static_path)
    monkeypatch.setattr(fast_decode, "compiled", no_static_path)
    auto = generate(base_model, PROMPTS, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(2))  # fmt: skip
    assert torch.equal(auto.tokens, eager.tokens) and torch.equal(auto.logprobs, eager.logprobs)


def test_generation_runs_the_blocks_under_their_training_wrappers(base_model, monkeypatch):
    """A model trained with torch.compile'd, checkpointed blocks (trainer.parallel) generates through the blocks
    themselves: through the compiled ones every prompt width, cache length and layer was a recompile, and with
    fullgraph=True the 9th failed (``FailOnRecompileLimitHit``: the first held-out evaluation of an RL run with
    trainer.compile=true). Tokens are the plain model's."""
    import copy

    from trainer.parallel import apply_activation_checkpointing

    reference = generate(base_model, PROMPTS, max_new_tokens=8, temperature=0)
    wrapped = copy.deepcopy(base_model)
    apply_activation_checkpointing(wrapped, "full")

    def fails_if_called(*args, **kwargs):
        raise AssertionError("a compiled block ran during generation")

    for index, block in enumerate(wrapped.layers):
        wrapped.layers[index] = torch.compile(block, fullgraph=True, backend=fails_if_called)
    for decode in ("eager", "static"):
        for prompts in (PROMPTS, [[3] * 20], [[4, 5]]):
            out = generate(wrapped, prompts, max_new_tokens=8, temperature=0, decode=decode)
            expected = reference if prompts is PROMPTS else generate(base_model, prompts, max_new_tokens=8, temperature=0)  # fmt: skip
            assert torch.equal(out.tokens, expected.tokens)


def test_static_cache_errors(base_model):
    with pytest.raises(ValueError, match="use_cache=True"):
        generate(base_model, PROMPTS, max_new_tokens=2, use_cache=False, static_cache=True)


# ---- first-token constraint and token healing ----


def test_first_token_mask_constrains_only_the_first_token(base_model):
    """Row 0 may only start with token 5, row 1 with 6 or 7; row 2 unconstrained. The first log-prob is that of
    the constrained distribution (the allowed logits renormalised), later steps are unchanged."""
    vocab = base_model.config.vocab_size
    allowed = torch.zeros((3, vocab), dtype=torch.bool)
    allowed[0, 5] = True
    allowed[1, [6, 7]] = True
    allowed[2] = True
    for static in (False, True):
        out = generate(
            base_model, PROMPTS, max_new_tokens=4, temperature=0, first_token_mask=allowed, static_cache=static
        )
        assert out.tokens[0, 0] == 5 and out.tokens[1, 0] in (6, 7)
        assert out.logprobs[0, 0] == 0.0  # the only allowed token has probability 1
        free = generate(base_model, [PROMPTS[2]], max_new_tokens=4, temperature=0)
        assert torch.equal(out.tokens[2], free.tokens[0])
        # the constrained first tokens, fed back, continue exactly as recomputation from them would
        for row in range(2):
            forced = generate(base_model, [PROMPTS[row] + [int(out.tokens[row, 0])]], max_new_tokens=3, temperature=0)
            assert torch.equal(out.tokens[row, 1:], forced.tokens[0])
    with pytest.raises(ValueError, match="first_token_mask must be a bool tensor"):
        generate(base_model, PROMPTS, max_new_tokens=2, first_token_mask=allowed[:2])
    with pytest.raises(ValueError, match="allows no token"):
        generate(base_model, PROMPTS, max_new_tokens=2, first_token_mask=torch.zeros((3, vocab), dtype=torch.bool))


def eos_loving_model(tokenizer, favoured: int) -> Transformer:
    """A tiny model whose logits put EOS first (+10) and ``favoured`` second (+5) after any context: the failure
    of issue 11, where greedy decoding after "ROMEO:" stops at once."""
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=tokenizer.vocab_size, multiple_of=32, max_seq_len=64
        )
    )
    bias = torch.zeros(tokenizer.vocab_size)
    bias[tokenizer.eos_id], bias[favoured] = 10.0, 5.0
    model.output.register_forward_hook(lambda module, inputs, output: output + bias.to(output.dtype))
    return model


def test_heal_prompt_backs_off_a_token_that_longer_tokens_extend():
    from data.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.load("default")
    prompt = tokenizer.encode("ROMEO:", bos=True)
    kept, removed, allowed = tokenizer.heal_prompt(prompt)
    assert kept == prompt[:-1] and removed == b":"
    pieces = [tokenizer.encoding.decode_single_token_bytes(i) for i in allowed]
    assert all(p.startswith(b":") for p in pieces) and b":\n" in pieces and prompt[-1] in allowed
    assert len(allowed) == len(tokenizer.tokens_starting_with(b":"))
    # nothing to heal: a special last token, or a prompt that would become empty
    chat = tokenizer.encode_chat_prompt([{"role": "user", "content": "hi"}])
    assert tokenizer.heal_prompt(chat) == (chat, b"", [])
    assert tokenizer.heal_prompt(prompt[-1:]) == (prompt[-1:], b"", [])


def test_healing_turns_an_empty_completion_into_text():
    """Issue 11: unhealed, greedy decoding after "ROMEO:" emits EOS at once (empty text); healed, the first token
    must extend ':' so it is ':\\n', and the returned text still continues the ORIGINAL prompt."""
    from data.tokenizer.tokenizer import Tokenizer
    from models.generation import complete

    tokenizer = Tokenizer.load("default")
    colon_newline = tokenizer.encode(":\n")
    assert len(colon_newline) == 1  # one merged token: why "ROMEO:" ends mid-token
    model = eos_loving_model(tokenizer, colon_newline[0])
    prompt = tokenizer.encode("ROMEO:", bos=True)
    assert complete(model, tokenizer, prompt, max_new_tokens=5, temperature=0) == ""
    healed = complete(model, tokenizer, prompt, max_new_tokens=5, temperature=0, heal=True)
    assert healed == "\n"  # ':\n' (the removed ':' cut off), then EOS: "ROMEO:" + "\n" is what was generated


@pytest.mark.slow
def test_cli_generate_heals_by_default(tmp_path):
    """End to end: `lantern generate` prints the prompt followed by text; --no-heal still runs."""
    from tests.helpers import run_cli

    common = ["generate", "--preset", "tiny", "--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0"]
    healed = run_cli(*common, "--device", "cpu")
    assert healed.stdout.startswith("ROMEO:") and len(healed.stdout.rstrip("\n")) > len("ROMEO:")
    plain = run_cli(*common, "--no-heal", "--device", "cpu")
    assert plain.stdout.startswith("ROMEO:")


def test_rows_leaving_a_compiled_batch_compile_a_few_variants_not_one_per_size(base_model, monkeypatch):
    """64 sampled rows stopping at different steps move through the batches of 64, 32, ... 1: the step compiles
    three times (the first shape, then the batch as a dynamic size, and a batch of one, which dynamo specialises),
    not once per size, so a rollout stays far from dynamo's recompile limit (8); the tokens are eager decoding's."""
    from torch._dynamo.backends.common import aot_autograd

    from models import fast_decode

    batches: list[int] = []

    def forward_compiler(graph, example_inputs):
        batches.append(next(t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 2))
        return graph

    torch._dynamo.reset()  # the recompile limit counts per code object: the step's earlier tests' variants count too
    step = torch.compile(fast_decode.decode_and_sample, backend=aot_autograd(fw_compiler=forward_compiler), fullgraph=True)  # fmt: skip
    monkeypatch.setattr(fast_decode, "compiled", lambda function: step)
    prompts = [[(row * 7 + j) % 120 + 1 for j in range(3 + row % 5)] for row in range(64)]
    first = generate(base_model, prompts, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    stops = [int(token) for token in first.tokens[:, 5].unique()[:20]]  # tokens that end rows at many lengths
    eager, compiled = (
        generate(base_model, prompts, max_new_tokens=40, temperature=1.0, stop_ids=stops, decode=decode,
                 generator=torch.Generator().manual_seed(1))
        for decode in ("eager", "compiled")
    )  # fmt: skip
    lengths = compiled.mask.sum(1)
    assert lengths.min() <= 2 and lengths.max() >= 20 and len(lengths.unique()) >= 10  # rows left at many steps
    assert torch.equal(compiled.tokens, eager.tokens) and torch.equal(compiled.mask, eager.mask)
    assert len(batches) <= 3 and 64 in batches, f"compiled for batches {batches}"
