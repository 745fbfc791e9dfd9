"""Held-out evaluation of an RL stage's policy (``HeldOutEvaluation``, a part of ``RLModule``): greedy answers, or
greedy tool episodes, to the held-out prompts, scored by the ground truth with its SE and by the reward; pass@k;
lm-eval's tasks; eval.csv / eval.png and heldout.json beside the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from alignment.shared.evaluation import heldout_summary, pass_at_k_summary, sample_answers
from models.files.atomic import write_atomically
from models.generation import left_pad
from trainer.callbacks import write_curves


class HeldOutEvaluation:
    """What ``RLModule`` evaluates with: it reads the module's config, policy, tokenizer, reward, checker and
    environment, and writes ``eval_history`` and ``heldout``."""

    def _gather(self, values: list[Any]) -> list[Any]:
        """Every rank's list, concatenated in rank order (ranks hold prompts rank, rank + world, ...)."""
        if self.trainer.world_size == 1 or not dist.is_initialized():
            return values
        gathered: list[list[Any]] = [[] for _ in range(self.trainer.world_size)]
        dist.all_gather_object(gathered, values)
        return [item for part in gathered for item in part]

    def _judge(self, prompt: dict, answer: str) -> float | None:
        return None if self.checker is None else self.checker(prompt["record"], answer)

    @torch.no_grad()
    def evaluate(self, pass_k: bool = False) -> None:
        """Greedy answers to this rank's share of the held-out prompts: ground-truth accuracy (``eval.checker``)
        with its SE, the reward of those answers, and (``pass_k``) pass@k of k samples per prompt."""
        eval_config = self.config.eval
        prompts = self.trainer.datamodule.val_prompts
        prompts = prompts[: eval_config.generations] if eval_config.generations else prompts
        mine = prompts[self.global_rank :: self.trainer.world_size]
        rewards: list[float] = []
        if self.environment is not None:  # greedy episodes, the tools in hand
            answers = []
            for start in range(0, len(mine), eval_config.batch_size):
                chunk = mine[start : start + eval_config.batch_size]
                responses = self.sample_episodes(chunk, temperature=0.0)
                answers += responses.answers
                rewards += self.reward.score(chunk, responses.answers, responses.input_ids, responses.real)[0].tolist()
        else:
            answers = [
                a[0]
                for a in sample_answers(
                    self.model, self.tokenizer, [p["prompt_ids"] for p in mine],
                    max_new_tokens=self.hp.response_max_tokens, batch_size=eval_config.batch_size,
                )
            ]  # fmt: skip
        if mine and self.environment is None:
            ids = [p["prompt_ids"] + self.tokenizer.encode(a) + [self.tokenizer.eot_id] for p, a in zip(mine, answers)]
            input_ids, real = left_pad(ids, self.tokenizer.pad_id, self.device)
            rewards = self.reward.score(mine, answers, input_ids, real)[0].tolist()
        scores = self._gather([(p["where"], self._judge(p, a)) for p, a in zip(mine, answers)])
        order = {p["where"]: i for i, p in enumerate(prompts)}
        scores.sort(key=lambda item: order[item[0]])
        summary = heldout_summary(prompts, [s for _, s in scores])
        metrics = {"eval/reward": self._mean_over_ranks(rewards)}
        if summary["n"]:
            metrics.update({"eval/gt_score": summary["accuracy"], "eval/gt_score_se": summary["se"]})
            metrics.update({f"eval/gt_score/{task}": v["accuracy"] for task, v in summary["per_task"].items()})
        if pass_k and eval_config.pass_k and self.checker is not None:
            summary["pass_at_k"] = self._pass_at_k(prompts)
            metrics[f"eval/pass_at_{eval_config.pass_k}"] = summary["pass_at_k"]["pass_at_k"]
        metrics.update(self._harness_metrics())
        self.heldout["before" if self.global_step == 0 else "after"] = {
            **summary, "step": self.global_step, "scores": [s for _, s in scores], "where": [w for w, _ in scores],
        }  # fmt: skip
        for name, value in metrics.items():
            self.eval_history.setdefault(name, []).append((self.global_step, value))
            self.log(name, value, on_step=True, rank_zero_only=True)

    def _harness_metrics(self) -> dict[str, float]:
        """The lm-eval tasks of ``eval.harness_tasks`` (scored by the run's ``HarnessValidation``), by logged name."""
        if not self.config.eval.harness_tasks:
            return {}
        from trainer.harness_validation import harness_of  # lm-eval: the eval extra

        scorer = harness_of(self.trainer)
        if scorer is None:  # a module fitted without the stage's callbacks
            return {}
        return {f"eval/harness/{k}": v for k, v in scorer.score(self.model, self.trainer, self.global_step).items()}

    def _mean_over_ranks(self, values: list[float]) -> float:
        # every rank joins the reduction, one with no held-out prompts too (skipping it would hang the others)
        return self.global_mean(torch.tensor(values, device=self.device, dtype=torch.float32))

    def _pass_at_k(self, prompts: list[dict]) -> dict[str, Any]:
        k, limit = self.config.eval.pass_k, self.config.eval.pass_k_prompts
        prompts = prompts[:limit] if limit else prompts
        mine = prompts[self.global_rank :: self.trainer.world_size]
        generator = torch.Generator(self.device).manual_seed(self.config.run.seed * 1000 + self.global_step)
        if self.environment is not None:  # k episodes a prompt
            repeated, answers, size = [p for p in mine for _ in range(k)], [], self.config.eval.batch_size
            for start in range(0, len(repeated), size):
                answers += self.sample_episodes(repeated[start : start + size], 1.0, generator).answers
            samples = [answers[i * k : (i + 1) * k] for i in range(len(mine))]
        else:
            samples = sample_answers(
                self.model, self.tokenizer, [p["prompt_ids"] for p in mine], max_new_tokens=self.hp.response_max_tokens,
                batch_size=self.config.eval.batch_size, samples=k, temperature=1.0, generator=generator,
            )  # fmt: skip
        scored = self._gather([(p["where"], [self._judge(p, a) for a in answers]) for p, answers in zip(mine, samples)])
        order = {p["where"]: i for i, p in enumerate(prompts)}
        scored.sort(key=lambda item: order[item[0]])
        return pass_at_k_summary(prompts, [s for _, s in scored], k)

    def on_train_end(self) -> None:
        """eval.png and eval.csv (metric,step,value) and heldout.json beside the run: the before/after numbers."""
        if not self.trainer.is_global_zero:
            return
        run_dir = Path(self.trainer.default_root_dir)
        if self.eval_history:
            curves = {k: v for k, v in self.eval_history.items() if k.count("/") == 1 and not k.endswith("_se")}
            title, axes = f"{self.stage.upper()}: greedy answers to held-out prompts", {"xlabel": "rollout", "ylabel": "score"}  # fmt: skip
            write_curves(curves, run_dir / "eval.csv", run_dir / "eval.png", title=title, **axes)
        if self.heldout:
            write_atomically(
                run_dir / "heldout.json", json.dumps(self.heldout, indent=1) + "\n", what="held-out results"
            )
