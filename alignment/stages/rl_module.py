"""What PPO and GRPO share (``RLModule``): sampling with a checkpointed generator, the frozen reference and reward,
the reference's log-probs, one global step per rollout, the one update loop every algorithm steps through
(``optimise``: an algorithm gives only its loss on a micro-batch, ``MicroBatchLoss``), and held-out evaluation
written beside the run."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from alignment.shared.episodes import Environment, Episode, episode_rows, generate_sampler, run_episodes
from alignment.shared.responses import response_logprobs
from alignment.shared.rewards import Checker, Reward, build_reward
from alignment.stages.rl_evaluation import HeldOutEvaluation
from models.adapters import adapters_disabled
from models.errors import CheckpointError
from models.generation import generate, left_pad
from models.model import Transformer
from models.model_config import adapter_config
from models.prefill import shared_prefix_length
from trainer.config import to_dict
from trainer.lm_module import LanguageModelModule
from trainer.parallel import unsharded_for_generation

log = logging.getLogger(__name__)


@dataclass
class Responses:
    """Sampled responses to a batch of prompts, as rows of left-padded prompt + right-padded response."""

    input_ids: Tensor  # (B, P + N)
    real: Tensor  # (B, P + N) bool, real tokens
    prompt_len: int  # P
    mask: Tensor  # (B, N) bool, real response tokens
    ended: Tensor  # (B,) bool, the response ended with an end-of-turn token
    answers: list[str]  # decoded responses, end-of-turn removed
    generation_time: float
    shared_prefix: int  # tokens every prompt starts with (a chat template's system turn): scored once for all rows
    episodes: list[Episode] | None = None  # the rows' tool episodes (their transcripts, turns and calls), if any


@dataclass
class MicroBatchLoss:
    """An algorithm's loss on one micro-batch, as the update loop (``RLModule.optimise``) takes it."""

    loss: Tensor  # the micro-batch's share of its minibatch's loss: already divided by the minibatch's weight total
    logp: Tensor  # (b, N) the policy's log-probs of the response tokens
    old_logp: Tensor  # (b, N) the sampling policy's: in the first minibatch logp - old_logp must be exactly 0
    mask: Tensor  # (b, N) real response tokens
    sums: dict[str, Tensor]  # detached statistics, summed over the rollout's micro-batches and then over the ranks


class RLModule(HeldOutEvaluation, LanguageModelModule):
    """Subclasses set ``self.hp`` (their hyperparameter section) and implement ``rl_step(prompts) -> metrics``."""

    stage = "rl"

    def __init__(
        self,
        config: Any,
        hyperparameters: Any,
        policy: Transformer,
        reference: Transformer | None,
        reward: Reward,
        tokenizer: Any,
        checker: Checker | None = None,
        environment: Environment | None = None,
    ) -> None:
        super().__init__(config)
        self.save_hyperparameters({"config": to_dict(config), "model": policy.config.to_dict()})
        self.automatic_optimization = False  # the rollout's updates are made by hand (``optimise``)
        self.hp = hyperparameters
        self.model, self.tokenizer, self.reward = policy, tokenizer, reward
        if reference is None and adapter_config(policy) is None:
            raise ValueError("an RL stage needs a reference model, or a policy with adapters (its base is then one)")
        # None: the reference is the policy with its adapters off (reference_logprobs), no second copy of the weights
        self.frozen = {} if reference is None else {"reference": reference.eval().requires_grad_(False)}
        self.checker = checker  # the ground truth of held-out answers; None: not measured
        self.environment = environment  # responses are multi-turn tool episodes (config.episodes); None: one turn
        if environment is not None:
            environment.rng.seed(config.run.seed)
        self.eval_history: dict[str, list[tuple[int, float]]] = {}
        self.heldout: dict[str, Any] = {}  # "before" / "after": summaries written to heldout.json
        # Random state must live on the device that samples (torch.multinomial and randperm refuse a generator
        # on another device), which is only known once Lightning has placed the module: see on_fit_start.
        self.sampler: torch.Generator | None = None
        self._pending_sampler_state: tuple[str, Tensor, int] | None = None  # from a checkpoint: _apply_sampler_state

    # ---- what the RL recipe (run_rl) asks of an algorithm, before the module is made ----

    @classmethod
    def build_reward(cls, config: Any) -> Reward:
        """The configured reward, loaded and checked: ``reward.terms``."""
        return build_reward(config.reward.terms)

    @classmethod
    def extra_models(cls, config: Any, policy: Transformer, reward: Reward) -> dict[str, nn.Module]:
        """The models beyond the policy and its reference (PPO's critic), by the keyword ``__init__`` takes."""
        return {}

    @classmethod
    def extra_adapters(cls, config: Any, models: dict[str, nn.Module], reward: Reward) -> dict[str, dict[str, Any]]:
        """With peft.kind=lora: the extra models' own adapters, added in place; their bases' records by attribute."""
        return {}

    @classmethod
    def plots(cls, config: Any, run_dir: Path) -> list[L.Callback]:
        """The stage's curves (``LossPlot``) in the run folder."""
        return []

    # ---- setup ----

    def on_fit_start(self) -> None:
        device = torch.device("cpu") if self.hp.frozen_device == "cpu" else self.device
        dtype = torch.bfloat16 if self.hp.frozen_dtype == "bfloat16" else torch.float32
        placed = self.hp.frozen_device != "same" or self.hp.frozen_dtype != "float32"
        if "reference" not in self.frozen and placed and self.trainer.is_global_zero:
            log.info(
                "%s.frozen_device=%s / frozen_dtype=%s place the reward model only: with peft.kind=lora the reference "
                "is the policy with its adapters off, on the policy's device and in its precision",
                self.stage, self.hp.frozen_device, self.hp.frozen_dtype,
            )  # fmt: skip
        self.frozen = {name: model.to(device=device, dtype=dtype) for name, model in self.frozen.items()}
        self.reward.place(device, dtype)
        self.sampler = torch.Generator(self.device).manual_seed(self.config.run.seed)
        self._apply_sampler_state()

    def _apply_sampler_state(self) -> None:
        """Restore the checkpoint's sampler state once both the sampler and the state exist: single-process and DDP
        runs restore the checkpoint before on_fit_start, FSDP (ModelParallelStrategy) after it."""
        if self.sampler is None or self._pending_sampler_state is None:
            return
        device_type, state, step = self._pending_sampler_state
        if device_type == self.sampler.device.type:
            self.sampler.set_state(state)
        else:  # CPU and CUDA generator states are different things: resume reproducibly, not identically
            log.warning(
                "the checkpoint's sampler state is for %s, this run samples on %s: reseeding with run.seed + step",
                device_type, self.sampler.device.type,
            )  # fmt: skip
            self.sampler.manual_seed(self.config.run.seed + step)
        self._pending_sampler_state = None

    def global_mean(self, values: Tensor) -> float:
        """The mean of ``values`` over every rank's elements."""
        pair = self.sum_over_ranks(
            torch.stack([values.float().sum(), torch.tensor(float(values.numel()), device=self.device)])
        )
        return float(pair[0] / pair[1]) if pair[1] > 0 else float("nan")

    def micro_batches(self, rows: Tensor) -> list[Tensor]:
        size = self.hp.micro_batch_size
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def optimise(
        self,
        loss_weights: Tensor,
        micro_loss: Callable[[Tensor, Tensor], MicroBatchLoss],
        updates: Callable[[], list[tuple[Any, Any, Any, float | None, str]]],
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], float]:
        """The rollout's updates, one loop for every algorithm: ``hp.epochs`` passes over its rows, the first in the
        rollout's order (so the first minibatch sees the sampling policy: ratio exactly 1), later ones shuffled by
        the checkpointed sampler; minibatches of ``hp.minibatch_size`` rows, each one guarded, clipped update of
        ``updates()`` (``apply_update``) after its micro-batches' backward passes. ``micro_loss(rows,
        weight_total)`` is the algorithm's loss, ``weight_total`` the minibatch's sum of the (B, N) ``loss_weights``
        over every rank, whatever the micro-batching. Returns the statistics' sums over the rollout and the ranks,
        this rank's sums over the first minibatch, and its largest |log-ratio| there (0 unless something is wrong)."""
        totals: dict[str, Tensor] = {}
        first: dict[str, Tensor] = {}
        first_log_ratio = torch.zeros((), device=self.device)
        self.grad_norms: dict[str, float] = {}
        batch = loss_weights.shape[0]
        for epoch in range(self.hp.epochs):
            order = (
                torch.arange(batch, device=self.device)
                if epoch == 0  # randperm's output must be on its generator's device
                else torch.randperm(batch, generator=self.sampler, device=self.sampler.device).to(self.device)
            )
            for start in range(0, batch, self.hp.minibatch_size):
                rows = order[start : start + self.hp.minibatch_size]
                weight_total = self.sum_over_ranks(loss_weights[rows].sum()).clamp(min=1e-8)
                for micro in self.micro_batches(rows):
                    out = micro_loss(micro, weight_total)
                    self.manual_backward(self.loss_to_backpropagate(out.loss))
                    if epoch == 0 and start == 0:
                        deviation = ((out.logp - out.old_logp).abs() * out.mask).max().detach()
                        first_log_ratio = torch.maximum(first_log_ratio, deviation)
                        for name, value in out.sums.items():
                            first[name] = first[name] + value if name in first else value
                    for name, value in out.sums.items():
                        totals[name] = totals[name] + value if name in totals else value
                self.apply_update(*updates())
        summed = self.sum_over_ranks(torch.stack(list(totals.values())))  # one all-reduce for all of them
        return dict(zip(totals, summed)), first, float(first_log_ratio)

    # ---- one training step = one rollout ----

    def training_step(self, prompts: list[dict], batch_idx: int) -> None:
        if self.global_step == 0:
            self.evaluate(pass_k=True)  # the "before" numbers
        start = time.perf_counter()
        metrics = self.rl_step(prompts)
        metrics["step_time"] = time.perf_counter() - start
        for name, value in metrics.items():
            shown = name in ("score", "kl", "accuracy")
            self.log(f"{self.stage}/{name}", float(value), on_step=True, prog_bar=shown, rank_zero_only=True)
        self.count_global_step()
        last = self.global_step >= self.trainer.max_steps
        if self.global_step % self.config.eval.every_n_rollouts == 0 or last:
            self.evaluate(pass_k=last)

    def rl_step(self, prompts: list[dict]) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__} must implement rl_step")

    @torch.no_grad()
    def sample(self, prompts: list[dict]) -> Responses:
        """One response per prompt (repeat a prompt to sample it several times), with the policy's weights
        gathered once under FSDP (which the compiled decode step needs: it runs the blocks under their compile,
        checkpointing and FSDP2 wrappers, ``models.fast_decode.decode_blocks``); with an environment, one episode
        per prompt."""
        if self.environment is not None:
            return self.sample_episodes(prompts)
        hp, tokenizer = self.hp, self.tokenizer
        prompt_ids = [p["prompt_ids"] for p in prompts]
        start = time.perf_counter()
        with unsharded_for_generation(self.model):
            out = generate(
                self.model, prompt_ids, max_new_tokens=hp.response_max_tokens, temperature=hp.temperature,
                top_k=hp.top_k, top_p=hp.top_p, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
                generator=self.sampler,
                decode="auto",  # compiled static decode on CUDA (CUDA graphs), eager on CPU: models.generation
            )  # fmt: skip
        generation_time = time.perf_counter() - start
        prompts, prompt_real = left_pad(prompt_ids, tokenizer.pad_id, self.device)
        tokens, mask = out.tokens.to(self.device), out.mask.to(self.device)
        last_token = tokens.gather(1, (mask.sum(1, keepdim=True) - 1).clamp(min=0))[:, 0]
        ended = torch.isin(last_token, torch.tensor(sorted(tokenizer.stop_ids), device=self.device)) & mask.any(1)
        answers = [tokenizer.decode([t for t in row[m].tolist() if t not in tokenizer.stop_ids]) for row, m in zip(tokens, mask)]  # fmt: skip
        return Responses(
            torch.cat([prompts, tokens], dim=1), torch.cat([prompt_real, mask], dim=1), prompts.shape[1], mask,
            ended, answers, generation_time, shared_prefix_length(prompt_ids),
        )  # fmt: skip

    def sample_episodes(
        self, prompts: list[dict], temperature: float | None = None, generator: torch.Generator | None = None
    ) -> Responses:
        """One multi-turn episode per prompt, every episode sampled together turn by turn (``run_episodes``); the
        rows' mask is on the policy's sampled tokens alone. Defaults: the rollout's temperature and sampler."""
        hp, tokenizer, limits = self.hp, self.tokenizer, self.config.episodes
        start = time.perf_counter()
        temperature = hp.temperature if temperature is None else temperature
        generator = self.sampler if generator is None else generator
        with unsharded_for_generation(self.model):
            sample = generate_sampler(
                self.model, tokenizer, generator, temperature=temperature, top_k=hp.top_k, top_p=hp.top_p
            )
            episodes = run_episodes(
                self.environment, tokenizer, prompts, sample, max_turns=limits.max_turns,
                turn_tokens=hp.response_max_tokens, episode_tokens=limits.max_tokens,
            )  # fmt: skip
        input_ids, real, width, mask = episode_rows(episodes, tokenizer.pad_id)
        input_ids, real, mask = input_ids.to(self.device), real.to(self.device), mask.to(self.device)
        ended = torch.tensor([e.ended == "answer" for e in episodes], device=self.device)
        shared = shared_prefix_length([e.ids[: e.prompt_len] for e in episodes])
        answers = [e.answer for e in episodes]
        return Responses(input_ids, real, width, mask, ended, answers, time.perf_counter() - start, shared, episodes)

    def score(self, prompts: list[dict], responses: Responses) -> tuple[Tensor, Tensor, dict[str, float]]:
        """(the reward the stage optimises, the reward before the end-of-turn penalty, statistics) per response:
        ``Reward.score`` minus ``missing_eos_penalty`` for a response cut off before its end-of-turn."""
        raw, parts = self.reward.score(prompts, responses.answers, responses.input_ids, responses.real)
        self.stop_if_not_finite(raw, "reward")  # a checker or reward model's NaN/Inf: the update is guarded
        scores = raw
        if self.hp.missing_eos_penalty is not None:
            scores = torch.where(responses.ended, raw, raw - self.hp.missing_eos_penalty)
        stats = {f"reward/{name}": self.global_mean(values) for name, values in parts.items()}
        return scores, raw, stats

    def policy_logprobs(self, model, input_ids: Tensor, real: Tensor, P: int, shared: int) -> tuple[Tensor, Tensor]:
        return response_logprobs(model, input_ids, real, P, self.hp.temperature, shared)

    def reference_logprobs(self, input_ids: Tensor, real: Tensor, P: int, shared: int) -> Tensor:
        """The reference's log-probs on the policy's device in fp32: the frozen reference's, computed where it lives
        (frozen_device may be cpu while the policy is on a GPU), or, without one (LoRA), the policy's with its
        adapters off (every rank runs it for every micro-batch, as FSDP2's all-gathers need)."""
        if "reference" not in self.frozen:
            with adapters_disabled(self.model), torch.no_grad():
                logp = self.policy_logprobs(self.model, input_ids, real, P, shared)[0]
            return logp.float()
        reference = self.frozen["reference"]
        device = next(reference.parameters()).device
        logp = self.policy_logprobs(reference, input_ids.to(device), real.to(device), P, shared)[0]
        return logp.to(device=self.device, dtype=torch.float32)

    def write_samples(self, prompts: list[dict], responses: Responses, scores: Tensor) -> None:
        """A W&B table of the rollout's first ``eval.table_rows`` responses and their scores (an episode: its whole
        transcript after the prompt, tool turns included)."""
        if not self.trainer.is_global_zero or not hasattr(self.logger, "log_table"):
            return
        shown = responses.answers
        if responses.episodes is not None:
            shown = [self.tokenizer.decode(e.ids[e.prompt_len :]) for e in responses.episodes]
        rows = [
            [self.global_step, self.tokenizer.decode(p["prompt_ids"]), answer, float(score)]
            for p, answer, score in list(zip(prompts, shown, scores.tolist()))[: self.config.eval.table_rows]
        ]
        self.logger.log_table(
            key=f"{self.stage}/samples", columns=["rollout", "prompt", "response", "score"], data=rows
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["rl"] = {
            "eval_history": self.eval_history, "heldout": self.heldout,
            "sampler": self.sampler.get_state(), "sampler_device": self.sampler.device.type,  # get_state is a CPU tensor
        }  # fmt: skip
        if self.environment is not None:
            checkpoint["rl"]["environment_rng"] = self.environment.rng.getstate()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "rl" not in checkpoint:
            raise CheckpointError(
                "the checkpoint has no RL state (written by an older Lantern, or by another stage): start the run "
                "afresh with checkpoint.resume=none or a new run.name"
            )
        state = checkpoint["rl"]
        step = int(checkpoint.get("global_step", 0))
        self._pending_sampler_state = (state.get("sampler_device", "cpu"), state["sampler"], step)
        self._apply_sampler_state()
        self.eval_history = {k: [tuple(p) for p in v] for k, v in state["eval_history"].items()}
        self.heldout = state.get("heldout", {})
        if self.environment is not None and "environment_rng" in state:
            rng = state["environment_rng"]
            self.environment.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
