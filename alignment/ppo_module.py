"""PPOModule: optimise the SFT policy against a reward model, with a KL penalty to the SFT reference. The stage
around it (checks, model loading, callbacks) is alignment/ppo.py.

Each training step is one rollout: generate responses to a batch of prompts (KV cache, policy in eval mode,
FSDP weights gathered once), score them, then several PPO epochs over minibatches. Optimisation is manual:
two optimisers (policy, critic) with their own schedules. Lightning's global step counts rollouts.

Rollout, reference and training passes all read log-probs and values through alignment/responses.py (which
states the position alignment) at the same temperature, so the first PPO ratio is exactly 1.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from alignment.evaluation import answer_prompts, exact_match
from alignment.losses import (
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
from alignment.responses import RewardFunction, Rollout, response_logprobs, response_values
from alignment.reward import normalize_reward
from alignment.rewards import Checker
from models.generation import generate, ids_and_positions, left_pad
from models.heads import ScalarModel, gather_last
from models.model import Transformer
from trainer.callbacks import write_curves
from trainer.config import PPOConfig, to_dict
from trainer.lm_module import LanguageModelModule
from trainer.optim import build_optimizer
from trainer.parallel import configure_parallelism, grad_norm_and_clip, unsharded_for_generation

log = logging.getLogger(__name__)


class PPOModule(LanguageModelModule):
    def __init__(
        self,
        config: PPOConfig,
        policy: Transformer,
        critic: ScalarModel,
        reference: Transformer,
        reward_model: ScalarModel | None,
        tokenizer: Any,
        *,
        reward_stats: dict[str, float] | None = None,
        reward_fn: RewardFunction | None = None,
        checker: Checker | None = None,
    ) -> None:
        super().__init__(config)
        self.save_hyperparameters({"config": to_dict(config), "model": policy.config.to_dict()})
        self.automatic_optimization = False
        self.model, self.critic, self.tokenizer = policy, critic, tokenizer
        # Frozen models are kept out of the module tree: never checkpointed (rebuilt from their folders on
        # resume), never sharded or moved by Lightning; placed by ppo.frozen_device / frozen_dtype.
        self.frozen = {"reference": reference.eval().requires_grad_(False)}
        if reward_model is not None:
            self.frozen["reward"] = reward_model.eval().requires_grad_(False)
        self.reward_fn = reward_fn
        self.checker = checker  # the ground truth of held-out answers (alignment/rewards.py); None: not measured
        self.reward_stats = reward_stats or {}
        ppo = config.ppo
        self.kl_controller = KLController(
            ppo.kl_coef, adaptive=ppo.kl_adaptive, target=ppo.kl_target, horizon=ppo.kl_horizon
        )
        self.eval_history: dict[str, list[tuple[int, float]]] = {}
        # Random state must live on the device that samples (torch.multinomial and randperm refuse a generator
        # on another device), which is only known once Lightning has placed the module: see on_fit_start.
        self.sampler: torch.Generator | None = None
        self._pending_sampler_state: tuple[str, Tensor] | None = None  # from a checkpoint, applied in on_fit_start

    # ---- setup ----

    def configure_model(self) -> None:
        configure_parallelism(self.model, self.trainer, self.config.trainer)
        configure_parallelism(self.critic, self.trainer, self.config.trainer)

    def on_fit_start(self) -> None:
        device = torch.device("cpu") if self.config.ppo.frozen_device == "cpu" else self.device
        dtype = torch.bfloat16 if self.config.ppo.frozen_dtype == "bfloat16" else torch.float32
        for name, model in self.frozen.items():
            self.frozen[name] = model.to(device=device, dtype=dtype)
        self.sampler = torch.Generator(self.device).manual_seed(self.config.run.seed)
        if self._pending_sampler_state is not None:
            device_type, state = self._pending_sampler_state
            if device_type == self.device.type:
                self.sampler.set_state(state)
            else:  # CPU and CUDA generator states are different things: resume reproducibly, not identically
                log.warning(
                    "the checkpoint's PPO sampler state is for %s, this run samples on %s: reseeding with run.seed + step",
                    device_type, self.device.type,
                )  # fmt: skip
                self.sampler.manual_seed(self.config.run.seed + self.global_step)
            self._pending_sampler_state = None

    def configure_optimizers(self) -> list[dict[str, Any]]:
        total_updates = (
            self.config.trainer.max_steps
            * self.config.ppo.epochs
            * (self.config.ppo.rollout_batch_size // self.config.ppo.minibatch_size)
        )
        optimizers = []
        for module, optim in ((self.model, self.config.optim), (self.critic, self.config.critic_optim)):
            optimizer, schedule = build_optimizer(
                module, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
                eps=optim.eps, warmup_steps=optim.warmup_steps, max_steps=total_updates,
                decay_embeddings_and_norms=optim.decay_embeddings_and_norms,
            )  # fmt: skip
            optimizers.append({"optimizer": optimizer, "lr_scheduler": schedule})
        return optimizers

    def _sum_over_ranks(self, tensor: Tensor) -> Tensor:
        return self.trainer.strategy.reduce(tensor, reduce_op="sum") if self.trainer.world_size > 1 else tensor

    # ---- one training step = one rollout and its PPO epochs ----

    def training_step(self, prompts: list[dict], batch_idx: int) -> None:
        if self.global_step == 0:
            self.evaluate()  # the "before" numbers
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
        for name, value in metrics.items():
            self.log(f"ppo/{name}", float(value), on_step=True, prog_bar=name in ("score", "kl"), rank_zero_only=True)
        self._count_rollout()
        every = self.config.eval.every_n_rollouts
        if self.global_step % every == 0 or self.global_step >= self.trainer.max_steps:
            self.evaluate()

    def _count_rollout(self) -> None:
        """Lightning counts a global step per optimiser.step() under manual optimisation; PPO steps two
        optimisers many times per rollout through the plain torch optimisers and counts the rollout here,
        so trainer.max_steps, checkpoint intervals and plots are all in rollouts."""
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    @torch.no_grad()
    def rollout(self, prompts: list[dict]) -> tuple[Rollout, dict[str, float]]:
        ppo, tokenizer = self.config.ppo, self.tokenizer
        start = time.perf_counter()
        with unsharded_for_generation(self.model):
            out = generate(
                self.model, [p["prompt_ids"] for p in prompts], max_new_tokens=ppo.response_max_tokens,
                temperature=ppo.temperature, top_k=ppo.top_k, top_p=ppo.top_p, stop_ids=tokenizer.stop_ids,
                pad_id=tokenizer.pad_id, generator=self.sampler,
                compile=self.config.trainer.compile and self.device.type == "cuda",  # CUDA graphs; CPU stays eager
            )  # fmt: skip
        generation_time = time.perf_counter() - start
        prompt_ids, prompt_real = left_pad([p["prompt_ids"] for p in prompts], tokenizer.pad_id, self.device)
        mask = out.mask.to(self.device)
        input_ids = torch.cat([prompt_ids, out.tokens.to(self.device)], dim=1)
        real = torch.cat([prompt_real, mask], dim=1)
        P = prompt_ids.shape[1]
        # Old log-probs by the training pass itself, in the same micro-batches the first PPO epoch uses:
        # the first minibatch's ratio is then exactly 1.
        old_logp, values, ref_logp = [], [], []
        for rows in self._micro_batches(torch.arange(len(prompts))):
            old_logp.append(self._policy_logprobs(self.model, input_ids[rows], real[rows], P)[0])
            values.append(self._values(input_ids[rows], real[rows], P))
            ref_logp.append(self._reference_logprobs(input_ids[rows], real[rows], P))
        old_logp, values, ref_logp = torch.cat(old_logp), torch.cat(values), torch.cat(ref_logp)
        raw_scores = self._scores(input_ids, real)
        scores = normalize_reward(raw_scores, self.reward_stats)
        last_token = out.tokens.to(self.device).gather(1, (mask.sum(1, keepdim=True) - 1).clamp(min=0))[:, 0]
        ended = torch.isin(last_token, torch.tensor(sorted(tokenizer.stop_ids), device=self.device))
        if ppo.missing_eos_penalty is not None:
            scores = torch.where(ended, scores, scores - ppo.missing_eos_penalty)
        if ppo.reward_clip is not None:
            scores = scores.clamp(-ppo.reward_clip, ppo.reward_clip)
        kl = kl_penalty(old_logp, ref_logp, ppo.kl_estimator) * mask
        rewards = token_rewards(scores, kl, mask, self.kl_controller.value)
        if ppo.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=True, reduce_sum=self._sum_over_ranks)
        advantages, returns = gae(rewards, values, mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = masked_whiten(advantages, mask, reduce_sum=self._sum_over_ranks)

        def mean(x):
            return self._sum_over_ranks(
                torch.stack([x.float().sum(), torch.tensor(float(x.numel()), device=self.device)])
            )

        stats = {
            "score": self._ratio(mean(scores)),
            "raw_score": self._ratio(mean(raw_scores)),
            "kl": self._ratio(mean(kl.sum(1))),  # per sequence
            "reward": self._ratio(mean((rewards * mask).sum(1))),
            "response_length": self._ratio(mean(mask.sum(1))),
            "ended_with_eos": self._ratio(mean(ended)),
            "generation_time": generation_time,
            "rollout_tokens_per_second": float(mask.sum()) / generation_time,
        }
        self._write_samples(prompts, out.tokens, mask, raw_scores)
        return Rollout(input_ids, real, P, mask, old_logp, values, advantages, returns), stats

    @staticmethod
    def _ratio(pair: Tensor) -> float:
        return float(pair[0] / pair[1].clamp(min=1))

    def _micro_batches(self, rows: Tensor) -> list[Tensor]:
        size = self.config.ppo.micro_batch_size
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def _policy_logprobs(self, model, input_ids: Tensor, real: Tensor, P: int) -> tuple[Tensor, Tensor]:
        return response_logprobs(model, input_ids, real, P, self.config.ppo.temperature)

    def _reference_logprobs(self, input_ids: Tensor, real: Tensor, P: int) -> Tensor:
        """The frozen reference's log-probs, computed where it lives (ppo.frozen_device may be cpu while the
        policy is on a GPU) and returned on the policy's device in fp32."""
        reference = self.frozen["reference"]
        device = next(reference.parameters()).device
        logp = self._policy_logprobs(reference, input_ids.to(device), real.to(device), P)[0]
        return logp.to(device=self.device, dtype=torch.float32)

    def _values(self, input_ids: Tensor, real: Tensor, P: int) -> Tensor:
        return response_values(self.critic, input_ids, real, P)

    def _scores(self, input_ids: Tensor, real: Tensor) -> Tensor:
        """Sequence scores read at each row's last real token (the end-of-turn token, never padding)."""
        if self.reward_fn is not None:
            return self.reward_fn(input_ids, real).float()
        reward_model = self.frozen["reward"]
        device = next(reward_model.parameters()).device
        document_ids, position_ids = ids_and_positions(real.to(device))
        scores = reward_model(input_ids.to(device), position_ids=position_ids, document_ids=document_ids)
        return gather_last(scores, real.to(device)).float().to(self.device)

    def update(self, rollout: Rollout) -> dict[str, float]:
        ppo = self.config.ppo
        policy_optimizer, critic_optimizer = (opt.optimizer for opt in self.optimizers())
        policy_schedule, critic_schedule = self.lr_schedulers()
        train_policy = self.global_step >= ppo.critic_warmup_rollouts
        self._grad_norms: dict[str, float] = {}
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
                token_count = self._sum_over_ranks(rollout.mask[rows].sum().float()).clamp(min=1)
                for micro in self._micro_batches(rows):
                    mask = rollout.mask[micro]
                    logp, entropy = self._policy_logprobs(
                        self.model, rollout.input_ids[micro], rollout.real[micro], rollout.prompt_len
                    )
                    values = self._values(rollout.input_ids[micro], rollout.real[micro], rollout.prompt_len)
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
                    # DDP/FSDP average gradients over ranks; the token_count above is already global
                    self.manual_backward(loss * self.trainer.world_size)
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
                self._step(critic_optimizer, critic_schedule, self.critic, self.config.critic_optim.grad_clip, "critic")
                if train_policy:
                    self._step(policy_optimizer, policy_schedule, self.model, self.config.optim.grad_clip, "policy")
                else:
                    policy_optimizer.zero_grad(set_to_none=True)
        totals = self._sum_over_ranks(totals)
        tokens = totals[6].clamp(min=1)
        first_tokens = self._sum_over_ranks(first[3].clone()).clamp(min=1)
        first_kl, first_clip = (self._sum_over_ranks(first[:2].clone()) / first_tokens).tolist()
        return {
            "policy_loss": float(totals[0] / tokens), "value_loss": float(totals[1] / tokens), "entropy": float(totals[2] / tokens),
            "approx_kl": float(totals[3] / tokens), "clip_fraction": float(totals[4] / tokens), "ratio": float(totals[5] / tokens),
            "explained_variance": float(explained_variance(rollout.values, rollout.returns, rollout.mask, self._sum_over_ranks)),
            "value_mean": float(masked_mean(rollout.values, rollout.mask, self._sum_over_ranks)),
            **{f"{name}_grad_norm": norm for name, norm in self._grad_norms.items()},
            "first_minibatch_approx_kl": first_kl, "first_minibatch_clip_fraction": first_clip,
            "first_minibatch_max_log_ratio": float(first[2]),
        }  # fmt: skip

    def _step(self, optimizer, schedule, module, max_norm: float | None, name: str) -> None:
        self._grad_norms[name] = float(grad_norm_and_clip(module.parameters(), max_norm))  # the last of the rollout
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()

    # ---- evaluation: greedy answers to held-out prompts ----

    def evaluate(self) -> None:
        """Mean ground-truth score (``eval.checker``, on the prompts it judges), exact match (with a reference)
        and reward-model score of greedy answers to this rank's share of the held-out prompts, over all ranks."""
        prompts = self.trainer.datamodule.val_prompts[: self.config.eval.generations]
        mine = prompts[self.global_rank :: self.trainer.world_size]
        answers = answer_prompts(
            self.model,
            self.tokenizer,
            [p["prompt_ids"] for p in mine],
            max_new_tokens=self.config.ppo.response_max_tokens,
            batch_size=self.config.eval.batch_size,
        )
        sums = torch.zeros(6, device=self.device)  # gt score, count, exact, count, rm score, count
        for prompt, answer in zip(mine, answers):
            score = self.checker(prompt["record"], answer) if self.checker is not None else None
            if score is not None:  # the checker judges this prompt
                sums[0:2] += torch.tensor([float(score), 1.0], device=self.device)
            if prompt["reference"] is not None:
                sums[2:4] += torch.tensor([float(exact_match(answer, prompt["reference"])), 1.0], device=self.device)
        if mine and (self.reward_fn is not None or "reward" in self.frozen):
            ids = [p["prompt_ids"] + self.tokenizer.encode(a) + [self.tokenizer.eot_id] for p, a in zip(mine, answers)]
            input_ids, real = left_pad(ids, self.tokenizer.pad_id, self.device)
            scores = normalize_reward(self._scores(input_ids, real), self.reward_stats)
            sums[4:6] += torch.stack([scores.sum(), torch.tensor(float(len(mine)), device=self.device)])
        sums = self._sum_over_ranks(sums).tolist()
        for name, (total, count) in {"gt_score": sums[0:2], "exact_match": sums[2:4], "rm_score": sums[4:6]}.items():
            if count:
                self.eval_history.setdefault(f"eval/{name}", []).append((self.global_step, total / count))
                self.log(f"eval/{name}", total / count, on_step=True, rank_zero_only=True)

    def _write_samples(self, prompts: list[dict], tokens: Tensor, mask: Tensor, scores: Tensor) -> None:
        if not self.trainer.is_global_zero or not hasattr(self.logger, "log_table"):
            return
        rows = [
            [
                self.global_step,
                self.tokenizer.decode(p["prompt_ids"]),
                self.tokenizer.decode(tokens[i][mask[i]].tolist()),
                float(scores[i]),
            ]
            for i, p in enumerate(prompts[: self.config.eval.table_rows])
        ]
        self.logger.log_table(key="ppo/samples", columns=["rollout", "prompt", "response", "score"], data=rows)

    def on_train_end(self) -> None:
        """eval.png and eval.csv (metric,step,value) beside the run: the before/after numbers."""
        if self.trainer.is_global_zero and self.eval_history:
            run_dir = Path(self.trainer.default_root_dir)
            title, axes = "PPO: greedy answers to held-out prompts", {"xlabel": "rollout", "ylabel": "score"}
            write_curves(self.eval_history, run_dir / "eval.csv", run_dir / "eval.png", title=title, **axes)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["ppo"] = {
            "kl_controller": self.kl_controller.state_dict(), "eval_history": self.eval_history,
            "sampler": self.sampler.get_state(), "sampler_device": self.sampler.device.type,  # get_state is a CPU tensor
        }  # fmt: skip

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint["ppo"]
        self.kl_controller.load_state_dict(state["kl_controller"])
        # Lightning restores before on_fit_start, where the sampler is created on the module's device
        self._pending_sampler_state = (state.get("sampler_device", "cpu"), state["sampler"])
        self.eval_history = {k: [tuple(p) for p in v] for k, v in state["eval_history"].items()}
