"""GRPO / RLOO, one file: ``GRPOModule`` (each rollout samples ``group_size`` responses per prompt, gives each the
group advantage, GRPO's normalised score or RLOO's leave-one-out, and gives the shared update loop its clipped
surrogate with the KL to the reference in the loss, normalised by the minibatch's tokens or responses over all
ranks; its curves; the reward is ``reward.terms``, a checker by default, and there is no critic: the group is the
baseline), then ``run_grpo``, the RL recipe given the stage's record (``registry.GRPO``).

    lantern grpo configs/grpo/tiny.yaml grpo.baseline=rloo
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from alignment.schemas.rl import GRPOConfig
from alignment.shared.episodes import Environment, episode_stats
from alignment.shared.losses import group_advantages, kl_penalty, ppo_policy_loss
from alignment.shared.rewards import Checker, Reward
from alignment.stages.registry import GRPO, Stage
from alignment.stages.rl import run_rl
from alignment.stages.rl_module import MicroBatchLoss, RLModule
from models.model import Transformer
from trainer.callbacks import LossPlot
from trainer.optim import optimizer_from_config


class GRPOModule(RLModule):
    stage = "grpo"

    def __init__(
        self,
        config: GRPOConfig,
        policy: Transformer,
        reference: Transformer | None,  # None: the policy with its adapters off (peft.kind=lora)
        reward: Reward,
        tokenizer: Any,
        *,
        checker: Checker | None = None,
        environment: Environment | None = None,  # responses are tool episodes (config.episodes)
    ) -> None:
        super().__init__(config, config.grpo, policy, reference, reward, tokenizer, checker, environment)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer, schedule = optimizer_from_config(self.model, self.config.optim, self.config.schedule_steps())
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    def rl_step(self, prompts: list[dict]) -> dict[str, float]:
        grpo = self.config.grpo
        start = time.perf_counter()
        group = [p for p in prompts for _ in range(grpo.group_size)]  # each prompt's responses side by side
        responses = self.sample(group)
        input_ids, real, P, mask = responses.input_ids, responses.real, responses.prompt_len, responses.mask
        shared = responses.shared_prefix
        on_policy = self.one_update(len(group))
        with torch.no_grad():
            old_logp, ref_logp = [], []
            for rows in self.micro_batches(torch.arange(len(group), device=self.device)):
                if not on_policy:
                    old_logp.append(self.policy_logprobs(self.model, input_ids[rows], real[rows], P, shared)[0])
                ref_logp.append(self.reference_logprobs(input_ids[rows], real[rows], P, shared))
            old_logp, ref_logp = (torch.cat(old_logp) if old_logp else None), torch.cat(ref_logp)
            scores, raw_scores, reward_stats = self.score(group, responses)
            grouped = scores.view(len(prompts), grpo.group_size)
            advantages = group_advantages(grouped, baseline=grpo.baseline, scale=grpo.scale_advantages).flatten()
        rollout_time = time.perf_counter() - start
        train_stats = self.update(input_ids, real, (P, shared), mask, old_logp, ref_logp, advantages)
        self.write_samples(group, responses, raw_scores)
        spread = grouped.std(-1)
        return {
            "score": self.global_mean(scores),
            "raw_score": self.global_mean(raw_scores),
            "solved_groups": self.global_mean((grouped.max(-1).values >= 1.0).float()),
            "zero_variance_groups": self.global_mean((spread == 0).float()),  # no learning signal from these
            "score_std_in_group": self.global_mean(spread),
            "response_length": self.global_mean(mask.sum(1)),
            "ended_with_eos": self.global_mean(responses.ended),
            "generation_time": responses.generation_time,
            "rollout_time": rollout_time,
            "train_time": time.perf_counter() - start - rollout_time,
            **(episode_stats(responses.episodes) if responses.episodes is not None else {}),  # turns, calls, ends
            **reward_stats,
            **train_stats,
        }

    def one_update(self, rollout: int) -> bool:
        """Whether a rollout of ``rollout`` sequences makes one update (one epoch, one minibatch): then the sampling
        policy's log-probs are that update's own forward, detached (ratio 1), as TRL takes them; a separate pass
        before it would cost a quarter of the step."""
        return self.config.grpo.epochs == 1 and self.config.grpo.minibatch_size >= rollout

    def update(
        self,
        input_ids: Tensor,
        real: Tensor,
        prompt: tuple[int, int],
        mask: Tensor,
        old_logp: Tensor | None,
        ref_logp: Tensor,
        advantages: Tensor,
    ) -> dict[str, float]:
        """The rollout's updates through the shared loop (``RLModule.optimise``); ``prompt``: (prompt length, shared
        prefix); ``old_logp`` None: one update, whose forward gives them."""
        grpo = self.config.grpo
        sampled: list[Tensor] = []  # old_logp None: each micro-batch's own, in rollout order
        token_advantages = advantages[:, None].expand_as(mask).float()
        # what each token's loss is multiplied by before the minibatch's sum is divided by the weights' total
        if grpo.loss_aggregation == "sequence":
            token_weights = mask / mask.sum(1, keepdim=True).clamp(min=1)  # each response's tokens sum to 1
        else:
            token_weights = mask.float()

        def micro_loss(micro: Tensor, weight_total: Tensor) -> MicroBatchLoss:
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
            penalty = ((grpo.kl_coef * kl_tokens - grpo.entropy_coef * entropy) * weights).sum()
            sums = {
                "policy_loss": policy_loss.detach() * weight_total, "kl": kl_tokens.sum().detach(),
                "entropy": (entropy * micro_mask).sum().detach(), "approx_kl": stats["approx_kl"],
                "clip_fraction": stats["clip_fraction"], "ratio": stats["ratio"],
                "tokens": micro_mask.sum().float(), "weights": weights.sum(),
            }  # fmt: skip
            return MicroBatchLoss(policy_loss + penalty / weight_total, logp, old, micro_mask, sums)

        optimizer, schedule = self.optimizers().optimizer, self.lr_schedulers()
        policy = (optimizer, schedule, self.model, self.config.optim.grad_clip, "policy")
        totals, _, first_log_ratio = self.optimise(token_weights, micro_loss, lambda: [policy])
        tokens = totals["tokens"].clamp(min=1)
        names = ("entropy", "approx_kl", "clip_fraction", "ratio")
        stats = {"kl_per_token": float(totals["kl"] / tokens), **{n: float(totals[n] / tokens) for n in names}}
        stats["policy_loss"] = float(
            totals["policy_loss"] / totals["weights"].clamp(min=1e-8)
        )  # weighted as the loss is
        old_logp = torch.cat(sampled) if old_logp is None else old_logp
        stats["kl"] = self.global_mean((kl_penalty(old_logp, ref_logp, "k1") * mask).sum(1))  # per sequence, k1
        stats["first_minibatch_max_log_ratio"] = first_log_ratio
        stats.update({f"{name}_grad_norm": norm for name, norm in self.grad_norms.items()})
        return stats

    @classmethod
    def plots(cls, config: GRPOConfig, run_dir: Path) -> list[L.Callback]:
        name = config.grpo.baseline.upper()
        return [
            LossPlot(
                run_dir,
                metrics=("grpo/score", "grpo/solved_groups", "grpo/zero_variance_groups"),
                title=f"{name}: mean score of the samples, groups with a solution, groups without signal",
                filename="reward.png",
                ylabel="per rollout",
            ),
            LossPlot(
                run_dir,
                metrics=("grpo/kl",),
                title=f"{name}: KL to the reference per sequence",
                filename="kl.png",
                ylabel="KL (nats)",
            ),
            LossPlot(run_dir, metrics=("grpo/policy_loss",), title=f"{name}: policy loss", filename="loss.png"),
        ]


def run_grpo(config: GRPOConfig, extra_callbacks: list | None = None, *, stage: Stage = GRPO) -> Path | None:
    """GRPO (or RLOO) through the RL recipe (``run_rl``); ``stage``: its record (a variant's own)."""
    return run_rl(config, stage, extra_callbacks)
