"""Held-out statistics (alignment/shared/evaluation.py) against hand-computed values: standard errors, pass@k, per-task
summaries, paired differences and their verdicts, and the disjointness check that guards every held-out set."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from alignment.shared.evaluation import (
    SampledKL,
    check_disjoint,
    heldout_summary,
    mean_and_se,
    mean_score,
    paired_difference,
    pass_at_k,
    pass_at_k_summary,
    sample_answers,
    verdict,
)
from models.errors import DataError
from models.model import ModelConfig, Transformer


def prompt(task: str, ids: list[int] | None = None, where: str = "f, row 1") -> dict:
    return {"record": {"task": task}, "prompt_ids": ids or [1, 2], "where": where}


def test_mean_and_standard_error_by_hand():
    mean, se = mean_and_se([1.0, 0.0, 1.0, 1.0])
    # sample variance: ((1/4)^2 * 3 + (3/4)^2) / 3 = 0.25 ; se = sqrt(0.25 / 4)
    assert mean == 0.75 and se == pytest.approx(0.25)
    assert mean_and_se([0.5]) == (0.5, 0.0)
    assert all(math.isnan(x) for x in mean_and_se([]))


def test_pass_at_k_unbiased_estimator_by_hand():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)  # pass@1 is the fraction correct
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 1 - 3/6
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 1, 5)


def test_heldout_summary_per_task_and_unjudged_prompts_left_out():
    prompts = [prompt("a"), prompt("a"), prompt("b"), prompt("b")]
    summary = heldout_summary(prompts, [1.0, 0.0, 1.0, None])
    assert summary["n"] == 3 and summary["accuracy"] == pytest.approx(2 / 3)
    assert summary["per_task"]["a"] == {"accuracy": 0.5, "se": pytest.approx(0.5), "n": 2}
    assert summary["per_task"]["b"] == {"accuracy": 1.0, "se": 0.0, "n": 1}


def test_pass_at_k_summary_needs_k_judged_samples():
    prompts = [prompt("a"), prompt("a")]
    summary = pass_at_k_summary(prompts, [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], k=2)
    assert summary["pass_at_k"] == pytest.approx((0.5 + 0.0) / 2) and summary["n"] == 2 and summary["k"] == 2


def test_mean_score_of_a_prompts_samples_leaves_unjudged_ones_out():
    assert mean_score([1.0, 0.0, None, 0.5]) == pytest.approx(0.5) and mean_score([None]) is None


def test_paired_difference_and_verdict():
    before = [0.0, 0.0, 1.0, 0.0, None]
    after = [1.0, 1.0, 1.0, 0.0, 1.0]  # the last prompt was judged for one model only: left out
    difference, se, n = paired_difference(after, before)
    assert (
        n == 4 and difference == pytest.approx(0.5) and se == pytest.approx(math.sqrt((4 * 0.25) / 3 / 4))
    )  # differences 1, 1, 0, 0
    assert verdict(0.5, 0.2) == "gain" and verdict(-0.5, 0.2) == "loss"
    assert verdict(0.39, 0.2) == "no clear difference" and verdict(float("nan"), 0.1) == "not measured"


def test_overlapping_held_out_prompts_are_refused_naming_the_first():
    train = [prompt("a", [1, 2, 3]), prompt("a", [4, 5])]
    check_disjoint(train, [prompt("a", [1, 2])], "data.val")  # a prefix is not the same prompt
    with pytest.raises(DataError, match=r"data.val: 1 of 2 held-out prompts .* \(first: val.jsonl, row 2\)"):
        check_disjoint(train, [prompt("a", [9]), prompt("a", [4, 5], "val.jsonl, row 2")], "data.val")


def kl_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=16, multiple_of=16, max_seq_len=32))  # fmt: skip
    with torch.no_grad():  # peaked distributions, so that two seeds' models differ by a clear KL
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    return model.eval()


TOKENS = SimpleNamespace(pad_id=0, stop_ids=[15], decode=lambda ids: " ".join(map(str, ids)))


def test_sampled_kl_on_the_samples_an_evaluation_draws_matches_the_exact_kl():
    """One new token per prompt: the sequence-level KL is the KL of the first-token distributions, computed
    exactly; the estimate from the samples ``sample_answers`` draws (``on_batch``) is within 4 of its SE of it,
    and a model's KL to itself is 0."""
    policy, reference, prompt = kl_model(0), kl_model(1), [3, 7, 5]
    with torch.no_grad():
        logp, ref_logp = (m(torch.tensor([prompt]))[0, -1].log_softmax(-1) for m in (policy, reference))
    exact = float((logp.exp() * (logp - ref_logp)).sum())
    estimate = SampledKL(reference, TOKENS)
    sample_answers(
        policy, TOKENS, [prompt] * 2000, max_new_tokens=1, batch_size=500, temperature=1.0,
        generator=torch.Generator().manual_seed(0), on_batch=estimate,
    )  # fmt: skip
    assert len(estimate.totals) == 2000 and exact > 0.1
    se = torch.tensor(estimate.totals).std().item() / 2000**0.5
    assert abs(estimate.value - exact) < 4 * se, (estimate.value, exact, se)
    itself = SampledKL(policy, TOKENS)
    sample_answers(policy, TOKENS, [prompt] * 8, max_new_tokens=6, temperature=1.0, on_batch=itself)
    assert abs(itself.value) < 1e-4
    assert math.isnan(SampledKL(policy, TOKENS).value)  # no samples yet: not a number, never a silent 0
