"""Alignment losses and RL maths. A loss here is a micro-batch's share of its optimizer step's loss: its sum
divided by a count over the whole step (all ranks, all micro-batches), so shares add up to the step's loss."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from models.sampling import scaled_logprobs

# ---------------------------------------------------------------------------------------------------------
# PPO. Tensors are (B, N) over response tokens with a (B, N) bool ``mask`` of real (non-pad) tokens.
# ``reduce_sum`` sums a tensor over ranks (identity in one process), so whitening and normalisation use
# the whole global batch and a multi-rank run computes what a single process would.


def identity(tensor: Tensor) -> Tensor:
    return tensor


def logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-prob of each target under ``logits / temperature`` and the entropy of that distribution.

    Temperature 0 (greedy sampling) is scored at 1, as ``models.generation`` scores it.
    """
    logp_all = scaled_logprobs(logits, temperature)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: Literal["k1", "k3"] = "k1") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1 / k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    return torch.expm1(-log_ratio) + log_ratio  # k3: (r - 1) - log r with r = ref/policy: unbiased, >= 0


def masked_mean(values: Tensor, mask: Tensor, reduce_sum=identity) -> Tensor:
    total = reduce_sum(torch.stack([(values * mask).sum(), mask.sum().to(values.dtype)]))
    return total[0] / total[1].clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, reduce_sum=identity) -> Tensor:
    """(x - mean) / std over valid tokens only (mean and variance over all ranks' valid tokens).

    ``shift_mean=False`` adds the mean back after scaling (TRL's variant). Lantern whitens advantages and,
    when asked, rewards with the mean removed: a mean added back to rewards would pay every token a bonus
    that says nothing about the response."""
    mean = masked_mean(values, mask, reduce_sum)
    variance = masked_mean((values - mean) ** 2, mask, reduce_sum)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """−β·KL on every response token, plus the sequence score on its last real token."""
    rewards = -kl_coef * kl * mask
    last = mask.long().cumsum(1).argmax(1)  # index of the last True
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the masked (policy) tokens of each response; returns (advantages,
    returns = A + V), zero off the mask.

    Masked-out positions are skipped, not ends: after a response they neither bootstrap nor get an advantage, and
    inside a tool episode the policy token before an observation bootstraps from the policy's next token, as if the
    observation were not in the row (the environment's tokens are not the policy's actions).
    """
    rewards, values, on = rewards.float(), values.float(), mask.bool()
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(running)  # the value of the next policy token (0 after the last)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(on[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(on[:, t], values[:, t], next_value)
        advantages[:, t] = running * on[:, t]
    return advantages, (advantages + values * on) * on


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio: float,
    token_count: Tensor,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate, summed over valid tokens and divided by ``token_count`` (the accumulated
    minibatch's valid tokens over all ranks); also approx-KL and clip fraction sums for logging. ``weights``
    (zero outside the mask) replaces the mask in the sum: e.g. 1 / response length per token, with the
    minibatch's response count as ``token_count``, for a per-sequence mean."""
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio)
    loss = (torch.maximum(unclipped, clipped) * (mask if weights is None else weights)).sum() / token_count
    stats = {
        "approx_kl": (0.5 * log_ratio.square() * mask).sum().detach(),
        "clip_fraction": (((ratio - 1).abs() > clip_ratio) & mask).sum().float().detach(),
        "ratio": (ratio * mask).sum().detach(),
    }
    return loss, stats


def ppo_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_value: float, token_count: Tensor
) -> Tensor:
    """Clipped value loss: the critic may not move further than ``clip_value`` from its rollout estimate
    unless that also lowers the error."""
    clipped = old_values + (values - old_values).clamp(-clip_value, clip_value)
    error = torch.maximum((values - returns).square(), (clipped - returns).square())
    return 0.5 * (error * mask).sum() / token_count


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, reduce_sum=identity) -> Tensor:
    """1 − Var(returns − values) / Var(returns): 1 is a perfect critic, 0 no better than a constant."""
    residual = returns - values
    var_returns = masked_mean((returns - masked_mean(returns, mask, reduce_sum)) ** 2, mask, reduce_sum)
    var_residual = masked_mean((residual - masked_mean(residual, mask, reduce_sum)) ** 2, mask, reduce_sum)
    return 1 - var_residual / var_returns.clamp(min=1e-8)


class KLController:
    """β of the KL penalty: fixed, or adaptive (Ziegler et al. 2019) toward a target KL per sequence (``target`` and
    ``horizon`` > 0: checked where ``ppo.*`` is read)."""

    def __init__(
        self, coef: float, *, adaptive: bool = False, target: float | None = None, horizon: int = 10000
    ) -> None:
        self.value = coef
        self.adaptive = adaptive
        self.target = target
        self.horizon = horizon

    def update(self, observed_kl: float, num_sequences: int) -> None:
        if not self.adaptive:
            return
        error = max(-0.2, min(0.2, observed_kl / self.target - 1))
        self.value *= 1 + error * num_sequences / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


# ---------------------------------------------------------------------------------------------------------
# Critic-free RL: advantages from a group of G sampled responses to the same prompt. ``scores`` is
# (num_prompts, G); each response's advantage applies to all of its tokens.


def group_advantages(
    scores: Tensor, *, baseline: Literal["grpo", "rloo"] = "grpo", scale: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO: (score − group mean) / group std (``scale=False`` keeps the difference, as Dr. GRPO argues, so
    near-unanimous groups are not blown up). RLOO: score − mean of the *other* G − 1 scores, an unbiased
    baseline because it does not depend on the response it judges. A group whose scores are all equal gets
    zero advantage either way: it says nothing about which response is better. G ≥ 2 (``grpo.group_size``'s
    declared range)."""
    scores = scores.float()
    if baseline == "grpo":
        centred = scores - scores.mean(-1, keepdim=True)
        return centred / (scores.std(-1, keepdim=True) + eps) if scale else centred
    others_mean = (scores.sum(-1, keepdim=True) - scores) / (scores.shape[-1] - 1)
    return scores - others_mean


# ---------------------------------------------------------------------------------------------------------
# Direct preference optimisation. Inputs are (B,) sequence log-probabilities of the chosen and rejected
# responses under the policy and the frozen reference: sums over response tokens for DPO, means over
# response tokens for IPO and SimPO (their papers' length normalisation; the caller reduces accordingly).

PreferenceLoss = Literal["dpo", "ipo", "simpo"]


def preference_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor | None,
    reference_rejected: Tensor | None,
    *,
    kind: PreferenceLoss = "dpo",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair losses (B,) and the implicit rewards of chosen and rejected, (B,) each, for logging margins
    and accuracy (chosen reward > rejected reward).

    - ``dpo`` (Rafailov et al. 2023): −log σ(β·h), h = (π_c − ref_c) − (π_r − ref_r); with label smoothing ε
      (conservative DPO) −(1−ε)·log σ(β·h) − ε·log σ(−β·h). Policy = reference gives log 2.
    - ``ipo`` (Azar et al. 2023): (h − 1/(2β))², which stops pushing once the margin reaches 1/(2β) instead of
      driving it to infinity on deterministic preferences.
    - ``simpo`` (Meng et al. 2024): −log σ(β·(π_c − π_r) − γ) with no reference model at all.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if kind == "simpo":
        chosen_rewards, rejected_rewards = beta * policy_chosen, beta * policy_rejected
        logits = chosen_rewards - rejected_rewards - simpo_gamma
    elif kind in ("dpo", "ipo"):
        if reference_chosen is None or reference_rejected is None:
            raise ValueError(f"{kind} needs the reference model's log-probabilities")
        chosen_rewards = beta * (policy_chosen - reference_chosen)
        rejected_rewards = beta * (policy_rejected - reference_rejected)
        logits = chosen_rewards - rejected_rewards
        if kind == "ipo":
            margin = logits / beta
            return (margin - 1 / (2 * beta)).square(), chosen_rewards.detach(), rejected_rewards.detach()
    else:
        raise ValueError(f"loss must be 'dpo', 'ipo' or 'simpo', got {kind!r}")
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()
