"""Preference losses and group advantages against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from alignment.shared.losses import group_advantages, preference_loss


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_dpo_equals_log2_when_policy_is_the_reference() -> None:
    logp_c, logp_r = t(-3.0, -10.0), t(-4.0, -2.0)
    losses, chosen, rejected = preference_loss(logp_c, logp_r, logp_c.clone(), logp_r.clone(), kind="dpo", beta=0.3)
    torch.testing.assert_close(losses, t(math.log(2), math.log(2)))
    assert chosen.abs().max() == 0 and rejected.abs().max() == 0


def test_dpo_hand_computed_with_and_without_label_smoothing() -> None:
    # h = (-1 - -1.5) - (-2 - -1.5) = 1, logits = beta * h = 0.5
    args = (t(-1.0), t(-2.0), t(-1.5), t(-1.5))
    losses, chosen, rejected = preference_loss(*args, kind="dpo", beta=0.5)
    torch.testing.assert_close(losses, t(math.log1p(math.exp(-0.5))))
    torch.testing.assert_close((chosen, rejected), (t(0.25), t(-0.25)))
    smoothed, _, _ = preference_loss(*args, kind="dpo", beta=0.5, label_smoothing=0.1)
    torch.testing.assert_close(smoothed, t(0.9 * math.log1p(math.exp(-0.5)) + 0.1 * math.log1p(math.exp(0.5))))


def test_ipo_is_zero_at_the_target_margin_and_quadratic_around_it() -> None:
    args = (t(-1.0), t(-2.0), t(-1.5), t(-1.5))  # margin h = 1
    at_target, _, _ = preference_loss(*args, kind="ipo", beta=0.5)  # 1 / (2 beta) = 1
    off_target, _, _ = preference_loss(*args, kind="ipo", beta=0.25)  # 1 / (2 beta) = 2
    torch.testing.assert_close(at_target, t(0.0))
    torch.testing.assert_close(off_target, t(1.0))


def test_simpo_needs_no_reference() -> None:
    losses, chosen, rejected = preference_loss(t(-1.0), t(-2.0), None, None, kind="simpo", beta=2.0, simpo_gamma=0.5)
    torch.testing.assert_close(losses, t(math.log1p(math.exp(-1.5))))  # logits = 2 * 1 - 0.5
    torch.testing.assert_close((chosen, rejected), (t(-2.0), t(-4.0)))


def test_dpo_gradient_raises_chosen_and_lowers_rejected() -> None:
    policy_c, policy_r = t(-2.0).requires_grad_(), t(-2.0).requires_grad_()
    losses, _, _ = preference_loss(policy_c, policy_r, t(-2.0), t(-2.0), kind="dpo", beta=0.1)
    losses.sum().backward()
    assert policy_c.grad.item() < 0 < policy_r.grad.item()  # descending the loss raises chosen log-prob


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "dpo", "beta": 0.0}, "beta"),
        ({"kind": "dpo", "label_smoothing": 0.5}, "label_smoothing"),
        ({"kind": "kto"}, "loss"),
    ],
)
def test_preference_loss_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preference_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), **kwargs)


def test_dpo_without_reference_log_probs_is_an_error() -> None:
    with pytest.raises(ValueError, match="reference"):
        preference_loss(t(-1.0), t(-2.0), None, None, kind="dpo")


def test_grpo_advantages_on_a_hand_made_group() -> None:
    scores = t(1.0, 0.0, 0.0, 1.0).reshape(1, 4)  # mean 0.5, unbiased std sqrt(1/3)
    expected = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(
        group_advantages(scores).double(), t(expected, -expected, -expected, expected).reshape(1, 4), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(group_advantages(scores, scale=False).double(), t(0.5, -0.5, -0.5, 0.5).reshape(1, 4))


def test_rloo_baseline_leaves_each_sample_out() -> None:
    scores = t(1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0).reshape(2, 4)
    # row 0: a 1 is judged against mean(1, 0, 0) = 1/3; row 1: 3 against 0, a 0 against 1
    expected = t(2 / 3, -2 / 3, -2 / 3, 2 / 3, 3.0, -1.0, -1.0, -1.0).reshape(2, 4)
    torch.testing.assert_close(group_advantages(scores, baseline="rloo").double(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("baseline", ["grpo", "rloo"])
def test_a_unanimous_group_has_no_advantage(baseline: str) -> None:
    assert group_advantages(t(0.7, 0.7, 0.7).reshape(1, 3), baseline=baseline).abs().max() < 1e-6


def test_ipo_hand_computed_away_from_the_target_with_its_rewards() -> None:
    # h = (-1 - -1.2) - (-2 - -1.5) = 0.7; target 1 / (2 * 0.25) = 2: (0.7 - 2)^2 = 1.69
    losses, chosen, rejected = preference_loss(t(-1.0), t(-2.0), t(-1.2), t(-1.5), kind="ipo", beta=0.25)
    torch.testing.assert_close(losses, t(1.69))
    torch.testing.assert_close((chosen, rejected), (t(0.05), t(-0.125)))  # beta * (policy - reference)


def test_simpo_with_label_smoothing_by_hand() -> None:
    # logits = 2 * (-1 - -2) - 0.5 = 1.5; smoothed: 0.8 * -log sigmoid(1.5) + 0.2 * -log sigmoid(-1.5)
    losses, _, _ = preference_loss(
        t(-1.0), t(-2.0), None, None, kind="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.2
    )
    torch.testing.assert_close(losses, t(0.8 * math.log1p(math.exp(-1.5)) + 0.2 * math.log1p(math.exp(1.5))))
