"""PPO, one file: ``PPOModule`` (each global step is one rollout: sample, score, GAE against the critic with a KL
penalty to the reference in the reward, then clipped-surrogate epochs through the shared update loop with two
optimisers, policy and critic; the first minibatch's ratio is exactly 1; what the RL recipe asks of it: a reward
model by default, a critic copied from it in its normalised units or a fresh value head on the policy's backbone,
with LoRA the critic's own adapters, its curves), then ``run_ppo``, the RL recipe given the stage's record
(``registry.PPO``).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from alignment.schemas.rl import PPOConfig
from alignment.shared.episodes import Environment, episode_stats
from alignment.shared.initial_model import add_model_adapters
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
from alignment.shared.responses import RewardFunction, Rollout, response_values
from alignment.shared.rewards import Checker, Reward, RewardTerm, build_reward, load_reward_model_score
from alignment.stages.registry import PPO, Stage
from alignment.stages.rl import run_rl
from alignment.stages.rl_module import MicroBatchLoss, RLModule
from models.errors import ConfigError
from models.heads import ScalarModel
from models.model import Transformer
from trainer.callbacks import LossPlot
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
        environment: Environment | None = None,  # responses are tool episodes (config.episodes)
    ) -> None:
        super().__init__(config, config.ppo, policy, reference, reward, tokenizer, checker, environment)
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
        responses = self.sample(prompts)
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
            **(episode_stats(responses.episodes) if responses.episodes is not None else {}),  # turns, calls, ends
            **reward_stats,
        }
        self.write_samples(prompts, responses, raw_scores)
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

    @classmethod
    def build_reward(cls, config: PPOConfig) -> Reward:
        """``reward.terms`` if any, else the reward model of ``init.reward_model``."""
        if config.reward.terms:
            return build_reward(config.reward.terms)
        if not config.init.reward_model:
            raise ConfigError(
                "init.reward_model is required (the reward-model folder, `lantern rm`), or name reward.terms"
            )
        return Reward(
            [
                RewardTerm(
                    "reward_model", 1.0, tokens=load_reward_model_score(config.init.reward_model, "init.reward_model")
                )
            ]
        )

    @classmethod
    def extra_models(cls, config: PPOConfig, policy: Transformer, reward: Reward) -> dict[str, ScalarModel]:
        """The critic, once the reward models are checked to share the policy's vocabulary."""
        for scorer in reward.models:
            if scorer.model.config.vocab_size != policy.config.vocab_size:
                raise ConfigError(
                    f"the reward model {scorer.path} has vocab_size {scorer.model.config.vocab_size}, "
                    f"the policy {config.init.policy} {policy.config.vocab_size}: they must share one tokenizer"
                )
        if critic_from_reward_model(config, reward):
            if reward.models:  # the reward is (partly) this model, in its normalised units: so are the critic's values
                critic = normalised_critic(reward.models[0].model, reward.models[0].stats)
            else:  # another reward (a checker, a function): the model's statistics say nothing of its scale
                critic = normalised_critic(
                    load_reward_model_score(config.init.reward_model, "init.reward_model").model, {}
                )
        else:
            critic = ScalarModel.from_backbone(copy.deepcopy(policy), init="zeros")
        return {"critic": critic.freeze_lm_head()}

    @classmethod
    def extra_adapters(cls, config: PPOConfig, models: dict[str, ScalarModel], reward: Reward) -> dict[str, dict]:
        """With peft.kind=lora, the critic's own adapters (in place) beside its fully trained score head (``head.``),
        and its base's record: the reward model's backbone it was copied from, or the policy's as loaded."""
        if not config.peft.enabled:
            return {}
        critic = models["critic"]
        if not critic_from_reward_model(config, reward):
            source = config.init.policy
        else:
            source = reward.models[0].path if reward.models else config.init.reward_model
        return {"critic": add_model_adapters(config, critic, source, base=critic.backbone, trainable=("head.",))}

    @classmethod
    def plots(cls, config: PPOConfig, run_dir: Path) -> list[L.Callback]:
        return [
            LossPlot(
                run_dir,
                metrics=("ppo/score", "ppo/reward"),
                title="PPO: score and total reward (score - KL penalty) per rollout",
                filename="reward.png",
                ylabel="mean per sequence",
            ),
            LossPlot(
                run_dir,
                metrics=("ppo/kl",),
                title="PPO: KL to the reference per sequence",
                filename="kl.png",
                ylabel="KL (nats)",
            ),
            LossPlot(run_dir, metrics=("ppo/policy_loss", "ppo/value_loss"), title="PPO losses", filename="loss.png"),
        ]


def normalised_critic(reward_model: ScalarModel, stats: dict[str, float]) -> ScalarModel:
    """A trainable critic copied from the reward model, its head rescaled by the model's exported ``stats`` so that
    it outputs (reward - mean) / std: the normalised units PPO's scores, and so its returns, are in (a copy in raw
    units starts far off: explained variance was -6 in the demo). Without stats, a plain copy."""
    critic = copy.deepcopy(reward_model).requires_grad_(True).train()
    if "reward_mean" in stats:
        std = max(float(stats["reward_std"]), 1e-6)
        with torch.no_grad():
            critic.head.proj.weight.div_(std)
            critic.head.proj.bias.sub_(float(stats["reward_mean"])).div_(std)
    return critic


def critic_from_reward_model(config: PPOConfig, reward: Reward) -> bool:
    """Whether the critic is a copy of a reward model (the reward's first, else init.reward_model's), not a fresh
    head on the policy's backbone."""
    return config.init.critic == "reward_model" and bool(reward.models or config.init.reward_model)


def run_ppo(
    config: PPOConfig,
    extra_callbacks: list | None = None,
    reward_fn: RewardFunction | None = None,
    *,
    stage: Stage = PPO,
) -> Path | None:
    """PPO through the RL recipe (``run_rl``); ``reward_fn`` replaces the configured reward; ``stage``: its record."""
    return run_rl(config, stage, extra_callbacks, reward_fn)
