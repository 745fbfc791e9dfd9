"""``PPOModule``: each global step is one rollout (sample, score, GAE against the critic, with a KL penalty to the
reference in the reward) and several clipped-surrogate epochs over minibatches, with two optimisers (policy,
critic); the first minibatch's ratio is exactly 1."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

from alignment.schemas.rl import PPOConfig
from alignment.shared.losses import (
    KLController,
    explained_variance,
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    token_rewards,
)
from alignment.shared.responses import Rollout, response_values
from alignment.shared.rewards import Checker, Reward
from alignment.stages.rl_module import MicroBatchLoss, RLModule
from models.heads import ScalarModel
from models.model import Transformer
from trainer.config import to_dict
from trainer.optim import optimizer_from_config
from trainer.parallel import configure_parallelism

log = logging.getLogger(__name__)


class PPOModule(RLModule):
    stage = "ppo"

    def __init__(
        self,
        config: PPOConfig,
        policy: Transformer,
        critic: ScalarModel,
        reference: Transformer | None,  # None: the policy with its adapters off (peft.kind=lora)
        reward: Reward,
        tokenizer: Any,
        *,
        checker: Checker | None = None,
    ) -> None:
        super().__init__(config, config.ppo, policy, reference, reward, tokenizer, checker)
        self.save_hyperparameters({"config": to_dict(config), "model": policy.config.to_dict()})
        self.automatic_optimization = False
        self.critic = critic
        ppo = config.ppo
        self.kl_controller = KLController(
            ppo.kl_coef, adaptive=ppo.kl_adaptive, target=ppo.kl_target, horizon=ppo.kl_horizon
        )

    def configure_model(self) -> None:
        configure_parallelism(self.model, self.trainer, self.config.trainer)
        configure_parallelism(self.critic, self.trainer, self.config.trainer)

    def configure_optimizers(self) -> list[dict[str, Any]]:
        total_updates = self.config.schedule_steps()
        optimizers = []
        for module, optim in ((self.model, self.config.optim), (self.critic, self.config.critic_optim)):
            optimizer, schedule = optimizer_from_config(module, optim, total_updates)
            optimizers.append({"optimizer": optimizer, "lr_scheduler": schedule})
        return optimizers

    # ---- one training step = one rollout and its PPO epochs ----

    def rl_step(self, prompts: list[dict]) -> dict[str, float]:
        start = time.perf_counter()
        rollout, rollout_stats = self.rollout(prompts)
        rollout_time = time.perf_counter() - start
        train_stats = self.update(rollout)
        train_time = time.perf_counter() - start - rollout_time
        self.kl_controller.update(rollout_stats["kl"], len(prompts) * self.trainer.world_size)
        metrics = {
            **rollout_stats,
            **train_stats,
            "kl_coef": self.kl_controller.value,
            "rollout_time": rollout_time,
            "train_time": train_time,
        }
        metrics["generation_share"] = rollout_stats["generation_time"] / (rollout_time + train_time)
        return metrics

    @torch.no_grad()
    def rollout(self, prompts: list[dict]) -> tuple[Rollout, dict[str, float]]:
        ppo = self.config.ppo
        responses = self.sample([p["prompt_ids"] for p in prompts])
        input_ids, real, P, mask = responses.input_ids, responses.real, responses.prompt_len, responses.mask
        shared = responses.shared_prefix
        # Old log-probs by the training pass itself, in the same micro-batches the first PPO epoch uses:
        # the first minibatch's ratio is then exactly 1.
        old_logp, values, ref_logp = [], [], []
        for rows in self.micro_batches(torch.arange(len(prompts))):
            old_logp.append(self.policy_logprobs(self.model, input_ids[rows], real[rows], P, shared)[0])
            values.append(response_values(self.critic, input_ids[rows], real[rows], P))
            ref_logp.append(self.reference_logprobs(input_ids[rows], real[rows], P, shared))
        old_logp, values, ref_logp = torch.cat(old_logp), torch.cat(values), torch.cat(ref_logp)
        scores, raw_scores, reward_stats = self.score(prompts, responses)
        if ppo.reward_clip is not None:
            scores = scores.clamp(-ppo.reward_clip, ppo.reward_clip)
        kl = torch.where(
            mask, kl_penalty(old_logp, ref_logp, ppo.kl_estimator), 0.0
        )  # k3's exp could overflow on padding
        rewards = token_rewards(scores, kl, mask, self.kl_controller.value)
        if ppo.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=True, reduce_sum=self.sum_over_ranks)
        advantages, returns = gae(rewards, values, mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = masked_whiten(advantages, mask, reduce_sum=self.sum_over_ranks)
        stats = {
            "score": self.global_mean(scores),
            "raw_score": self.global_mean(raw_scores),
            "kl": self.global_mean(kl.sum(1)),  # per sequence
            "reward": self.global_mean((rewards * mask).sum(1)),
            "response_length": self.global_mean(mask.sum(1)),
            "ended_with_eos": self.global_mean(responses.ended),
            "generation_time": responses.generation_time,
            "rollout_tokens_per_second": float(mask.sum()) / responses.generation_time,
            **reward_stats,
        }
        self.write_samples(prompts, responses.answers, raw_scores)
        return Rollout(input_ids, real, P, shared, mask, old_logp, values, advantages, returns), stats

    def update(self, rollout: Rollout) -> dict[str, float]:
        """The rollout's PPO epochs through the shared loop (``RLModule.optimise``): the critic learns from the
        first rollout, the policy once ``ppo.critic_warmup_rollouts`` have passed."""
        ppo = self.config.ppo
        policy_optimizer, critic_optimizer = (opt.optimizer for opt in self.optimizers())
        policy_schedule, critic_schedule = self.lr_schedulers()
        train_policy = self.global_step >= ppo.critic_warmup_rollouts

        def micro_loss(micro: Tensor, token_count: Tensor) -> MicroBatchLoss:
            mask, input_ids, real, P = rollout.mask[micro], rollout.input_ids[micro], rollout.real[micro], rollout.prompt_len  # fmt: skip
            logp, entropy = self.policy_logprobs(self.model, input_ids, real, P, rollout.shared_prefix)
            values = response_values(self.critic, input_ids, real, P)
            old = rollout.old_logp[micro]
            policy_loss, stats = ppo_policy_loss(
                logp, old, rollout.advantages[micro], mask, ppo.clip_ratio, token_count
            )
            value_loss = ppo_value_loss(
                values, rollout.values[micro], rollout.returns[micro], mask, ppo.clip_value, token_count
            )
            entropy_sum = (entropy * mask).sum()
            loss = value_loss
            if train_policy:
                loss = loss + policy_loss - ppo.entropy_coef * entropy_sum / token_count
            sums = {
                "policy_loss": policy_loss.detach() * token_count, "value_loss": value_loss.detach() * token_count,
                "entropy": entropy_sum.detach(), "approx_kl": stats["approx_kl"],
                "clip_fraction": stats["clip_fraction"], "ratio": stats["ratio"], "tokens": mask.sum().float(),
            }  # fmt: skip
            return MicroBatchLoss(loss, logp, old, mask, sums)

        def updates() -> list[tuple]:
            critic = (critic_optimizer, critic_schedule, self.critic, self.config.critic_optim.grad_clip, "critic")
            if not train_policy:
                policy_optimizer.zero_grad(set_to_none=True)
                return [critic]
            return [critic, (policy_optimizer, policy_schedule, self.model, self.config.optim.grad_clip, "policy")]

        totals, first, first_log_ratio = self.optimise(rollout.mask.float(), micro_loss, updates)
        tokens = totals["tokens"].clamp(min=1)
        # the first minibatch sees the policy the rollout saw: ratio 1, approx-KL 0, clip fraction 0 — or a bug
        first_sums = self.sum_over_ranks(torch.stack([first["approx_kl"], first["clip_fraction"], first["tokens"]]))
        first_kl, first_clip = (first_sums[:2] / first_sums[2].clamp(min=1)).tolist()
        names = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "ratio")
        return {
            **{name: float(totals[name] / tokens) for name in names},
            "explained_variance": float(explained_variance(rollout.values, rollout.returns, rollout.mask, self.sum_over_ranks)),
            "value_mean": float(masked_mean(rollout.values, rollout.mask, self.sum_over_ranks)),
            **{f"{name}_grad_norm": norm for name, norm in self.grad_norms.items()},
            "first_minibatch_approx_kl": first_kl, "first_minibatch_clip_fraction": first_clip,
            "first_minibatch_max_log_ratio": first_log_ratio,
        }  # fmt: skip

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["ppo"] = {"kl_controller": self.kl_controller.state_dict()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.kl_controller.load_state_dict(checkpoint["ppo"]["kl_controller"])
