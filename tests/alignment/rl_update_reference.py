"""The RL update loops as PPOModule and GRPOModule each carried them before the loop moved into RLModule (issue 50):
the oracle that the shared loop (``RLModule.optimise``) changes no weight, bit for bit, on the same seeds
(``test_rl_update_loop.py``). Kept verbatim but for their names; not used by Lantern."""

from __future__ import annotations

import torch
from torch import Tensor

from alignment.shared.losses import explained_variance, kl_penalty, masked_mean, ppo_policy_loss, ppo_value_loss
from alignment.shared.responses import Rollout, response_values


def grpo_update(
    self,
    input_ids: Tensor,
    real: Tensor,
    prompt: tuple[int, int],
    mask: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor,
    advantages: Tensor,
) -> dict[str, float]:
    """The rollout's updates; ``prompt``: (prompt length, shared prefix); ``old_logp`` None: one update, whose
    forward gives them."""
    grpo = self.config.grpo
    sampled: list[Tensor] = []  # old_logp None: each micro-batch's own, in rollout order
    optimizer, schedule = self.optimizers().optimizer, self.lr_schedulers()
    token_advantages = advantages[:, None].expand_as(mask).float()
    # what each token's loss is multiplied by before the minibatch's sum is divided by the weights' total
    if grpo.loss_aggregation == "sequence":
        token_weights = mask / mask.sum(1, keepdim=True).clamp(min=1)  # each response's tokens sum to 1
    else:
        token_weights = mask.float()
    totals = torch.zeros(8, device=self.device)  # policy loss, kl, entropy, approx-kl, clip, ratio, tokens, weights
    first_log_ratio = torch.zeros((), device=self.device)
    batch = mask.shape[0]
    for epoch in range(grpo.epochs):
        # the first epoch keeps the rollout's order and micro-batches: its first ratio is exactly 1
        order = (
            torch.arange(batch, device=self.device)
            if epoch == 0
            else torch.randperm(batch, generator=self.sampler, device=self.sampler.device).to(self.device)
        )
        for start in range(0, batch, grpo.minibatch_size):
            rows = order[start : start + grpo.minibatch_size]
            weight_total = self.sum_over_ranks(token_weights[rows].sum()).clamp(min=1e-8)
            for micro in self.micro_batches(rows):
                micro_mask, weights = mask[micro], token_weights[micro]
                logp, entropy = self.policy_logprobs(self.model, input_ids[micro], real[micro], *prompt)
                if old_logp is None:
                    sampled.append(logp.detach())
                old = sampled[-1] if old_logp is None else old_logp[micro]
                policy_loss, stats = ppo_policy_loss(
                    logp, old, token_advantages[micro], micro_mask, grpo.clip_ratio, weight_total, weights
                )
                # masked before the sum: k3's exp at a padding position could overflow, and inf * 0 is NaN
                kl_tokens = torch.where(micro_mask, kl_penalty(logp, ref_logp[micro], grpo.kl_estimator), 0.0)
                kl, entropy_sum = kl_tokens.sum(), (entropy * micro_mask).sum()
                penalty = ((grpo.kl_coef * kl_tokens - grpo.entropy_coef * entropy) * weights).sum()
                loss = policy_loss + penalty / weight_total
                self.manual_backward(self.loss_to_backpropagate(loss))
                if epoch == 0 and start == 0:
                    deviation = ((logp - old).abs() * micro_mask).max().detach()
                    first_log_ratio = torch.maximum(first_log_ratio, deviation)
                totals += torch.stack([
                    policy_loss.detach() * weight_total, kl.detach(), entropy_sum.detach(), stats["approx_kl"],
                    stats["clip_fraction"], stats["ratio"], micro_mask.sum().float(), weights.sum(),
                ])  # fmt: skip
            self.apply_update((optimizer, schedule, self.model, self.config.optim.grad_clip, "policy"))
    totals = self.sum_over_ranks(totals)
    tokens = totals[6].clamp(min=1)
    names = ("kl_per_token", "entropy", "approx_kl", "clip_fraction", "ratio")
    stats = {name: float(totals[i] / tokens) for i, name in enumerate(names, start=1)}
    stats["policy_loss"] = float(totals[0] / totals[7].clamp(min=1e-8))  # weighted as the loss is
    old_logp = torch.cat(sampled) if old_logp is None else old_logp
    stats["kl"] = self.global_mean((kl_penalty(old_logp, ref_logp, "k1") * mask).sum(1))  # per sequence, k1
    stats["first_minibatch_max_log_ratio"] = float(first_log_ratio)
    stats.update({f"{name}_grad_norm": norm for name, norm in self.grad_norms.items()})
    return stats


def ppo_update(self, rollout: Rollout) -> dict[str, float]:
    ppo = self.config.ppo
    policy_optimizer, critic_optimizer = (opt.optimizer for opt in self.optimizers())
    policy_schedule, critic_schedule = self.lr_schedulers()
    train_policy = self.global_step >= ppo.critic_warmup_rollouts
    self.grad_norms: dict[str, float] = {}
    totals = torch.zeros(7, device=self.device)  # policy loss, value loss, entropy, approx-kl, clip, ratio, tokens
    # the first minibatch sees the policy the rollout saw: ratio 1, approx-KL 0, clip fraction 0 — or a bug
    first = torch.zeros(4, device=self.device)
    batch = rollout.mask.shape[0]
    for epoch in range(ppo.epochs):
        # The first epoch keeps the rollout's order (and so its micro-batches): the ratio starts at exactly 1.
        # randperm's output must be on its generator's device
        order = (
            torch.arange(batch, device=self.device)
            if epoch == 0
            else torch.randperm(batch, generator=self.sampler, device=self.sampler.device)
        )
        for start in range(0, batch, ppo.minibatch_size):
            rows = order[start : start + ppo.minibatch_size]
            # normalise by the valid tokens of the whole minibatch on all ranks, whatever its micro-batching
            token_count = self.sum_over_ranks(rollout.mask[rows].sum().float()).clamp(min=1)
            for micro in self.micro_batches(rows):
                mask = rollout.mask[micro]
                logp, entropy = self.policy_logprobs(
                    self.model,
                    rollout.input_ids[micro],
                    rollout.real[micro],
                    rollout.prompt_len,
                    rollout.shared_prefix,
                )
                values = response_values(self.critic, rollout.input_ids[micro], rollout.real[micro], rollout.prompt_len)
                policy_loss, stats = ppo_policy_loss(
                    logp, rollout.old_logp[micro], rollout.advantages[micro], mask, ppo.clip_ratio, token_count
                )
                value_loss = ppo_value_loss(
                    values, rollout.values[micro], rollout.returns[micro], mask, ppo.clip_value, token_count
                )
                entropy_sum = (entropy * mask).sum()
                loss = value_loss
                if train_policy:
                    loss = loss + policy_loss - ppo.entropy_coef * entropy_sum / token_count
                self.manual_backward(self.loss_to_backpropagate(loss))
                if epoch == 0 and start == 0:
                    deviation = ((logp - rollout.old_logp[micro]).abs() * mask).max().detach()
                    first += torch.stack(
                        [
                            stats["approx_kl"],
                            stats["clip_fraction"],
                            torch.zeros_like(deviation),
                            mask.sum().float(),
                        ]
                    )
                    first[2] = torch.maximum(first[2], deviation)
                totals += torch.stack([
                    policy_loss.detach() * token_count, value_loss.detach() * token_count, entropy_sum.detach(),
                    stats["approx_kl"], stats["clip_fraction"], stats["ratio"], mask.sum().float(),
                ])  # fmt: skip
            critic = (critic_optimizer, critic_schedule, self.critic, self.config.critic_optim.grad_clip, "critic")
            if train_policy:
                policy = (policy_optimizer, policy_schedule, self.model, self.config.optim.grad_clip, "policy")
                self.apply_update(critic, policy)
            else:
                self.apply_update(critic)
                policy_optimizer.zero_grad(set_to_none=True)
    totals = self.sum_over_ranks(totals)
    tokens = totals[6].clamp(min=1)
    first_tokens = self.sum_over_ranks(first[3].clone()).clamp(min=1)
    first_kl, first_clip = (self.sum_over_ranks(first[:2].clone()) / first_tokens).tolist()
    return {
        "policy_loss": float(totals[0] / tokens), "value_loss": float(totals[1] / tokens), "entropy": float(totals[2] / tokens),
        "approx_kl": float(totals[3] / tokens), "clip_fraction": float(totals[4] / tokens), "ratio": float(totals[5] / tokens),
        "explained_variance": float(explained_variance(rollout.values, rollout.returns, rollout.mask, self.sum_over_ranks)),
        "value_mean": float(masked_mean(rollout.values, rollout.mask, self.sum_over_ranks)),
        **{f"{name}_grad_norm": norm for name, norm in self.grad_norms.items()},
        "first_minibatch_approx_kl": first_kl, "first_minibatch_clip_fraction": first_clip,
        "first_minibatch_max_log_ratio": float(first[2]),
    }  # fmt: skip
