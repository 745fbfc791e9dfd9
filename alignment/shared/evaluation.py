"""Held-out evaluation every stage shares: answers to chat prompts (greedy, or k samples each), their scores, and the
statistics that say whether a difference is real.

The standard error of a mean of per-prompt scores is sd / sqrt(n) (sample sd); two models that answered the same
prompts are compared by their paired per-prompt differences (a much smaller SE than the two combined), and a
difference is a gain or a loss only beyond 2 SE. pass@k is Chen et al.'s (2021) unbiased estimator from n >= k
samples. A prompt a checker cannot judge (None) is left out of the mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from alignment.shared.responses import response_logprobs
from models.errors import DataError
from models.generation import generate, left_pad
from models.prefill import shared_prefix_length
from models.sampling import GenerationOutput
from trainer.parallel import unsharded_for_generation

Judge = Callable[[dict[str, Any], str], "float | None"]  # (prompt dict, answer) -> score in [0, 1] or None


def sample_answers(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    batch_size: int = 16,
    samples: int = 1,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    decode: str = "auto",
    on_batch: Callable[[list[list[int]], GenerationOutput], None] | None = None,
    progress: str | None = None,
) -> list[list[str]]:
    """``samples`` decoded answers (end-of-turn removed) to each already-encoded chat prompt, batched by length;
    temperature 0 is greedy. ``max_new_tokens`` may differ per prompt (e.g. the reference length plus a margin):
    a batch runs to the largest of its members and each answer is then cut to its own budget. ``decode``: as
    ``models.generation.generate`` (auto: the compiled static decode on CUDA, eager on CPU). ``on_batch`` sees each
    batch's prompts and generation (e.g. ``SampledKL``); ``progress`` names a progress bar over the answers."""
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    jobs = sorted(
        ((i, s) for i in range(len(prompts)) for s in range(samples)), key=lambda job: len(prompts[job[0]])
    )  # similar lengths together: little padding
    answers: list[list[str]] = [[""] * samples for _ in prompts]
    bar = tqdm(total=len(jobs), desc=progress, unit="answer", disable=progress is None)
    with unsharded_for_generation(model), bar:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            batch = [list(prompts[i]) for i, _ in chunk]
            out = generate(
                model, batch, max_new_tokens=max(budgets[i] for i, _ in chunk),
                temperature=temperature, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id, generator=generator,
                decode=decode,
            )  # fmt: skip
            if on_batch is not None:
                on_batch(batch, out)
            for row, (index, sample) in enumerate(chunk):
                tokens = out.tokens[row][out.mask[row]].tolist()[: budgets[index]]
                answers[index][sample] = tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids])
            bar.update(len(chunk))
    return answers


def answer_prompts(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    batch_size: int = 16,
    decode: str = "auto",
) -> list[str]:
    """Greedy answers to already-encoded chat prompts (see ``sample_answers``)."""
    greedy = sample_answers(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, decode=decode
    )
    return [answers[0] for answers in greedy]


def exact_match(answer: str, reference: str) -> bool:
    return answer.strip() == reference.strip()


def accuracy(answers: Sequence[str], references: Sequence[str]) -> float:
    if not references:
        return float("nan")
    return sum(exact_match(a, r) for a, r in zip(answers, references)) / len(references)


# ---- statistics ----


def mean_and_se(scores: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample sd / sqrt(n)); (nan, nan) for no scores, SE 0 for one."""
    n = len(scores)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(scores) / n
    if n == 1:
        return mean, 0.0
    variance = sum((s - mean) ** 2 for s in scores) / (n - 1)
    return mean, math.sqrt(variance / n)


def mean_score(scores: Sequence[float | None]) -> float | None:
    """The mean of the judged scores (None: not judged, left out); None when none was judged."""
    judged = [s for s in scores if s is not None]
    return sum(judged) / len(judged) if judged else None


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which ``correct`` are correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= correct <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None: JSON has no NaN (Python writes a bare ``NaN``
    that strict parsers refuse), and "not measured" is what it means here."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def task_of(prompt: dict[str, Any]) -> str:
    return str(prompt.get("record", {}).get("task", "all"))


def heldout_summary(prompts: Sequence[dict[str, Any]], scores: Sequence[float | None]) -> dict[str, Any]:
    """``{"accuracy", "se", "n", "per_task": {task: {"accuracy", "se", "n"}}}`` of per-prompt scores (None: not
    judged, left out)."""
    by_task: dict[str, list[float]] = {}
    for prompt, score in zip(prompts, scores):
        if score is not None:
            by_task.setdefault(task_of(prompt), []).append(float(score))
    everything = [s for task_scores in by_task.values() for s in task_scores]
    mean, se = mean_and_se(everything)
    per_task = {}
    for task in sorted(by_task):
        task_mean, task_se = mean_and_se(by_task[task])
        per_task[task] = {"accuracy": task_mean, "se": task_se, "n": len(by_task[task])}
    return {"accuracy": mean, "se": se, "n": len(everything), "per_task": per_task}


def pass_at_k_summary(
    prompts: Sequence[dict[str, Any]], sample_scores: Sequence[Sequence[float | None]], k: int, threshold: float = 1.0
) -> dict[str, Any]:
    """pass@k over prompts (a sample passes when it scores >= ``threshold``), with its SE and per task."""
    values: list[float | None] = []
    for scores in sample_scores:
        judged = [s for s in scores if s is not None]
        values.append(pass_at_k(len(judged), sum(s >= threshold for s in judged), k) if len(judged) >= k else None)
    summary = heldout_summary(prompts, values)
    return {"k": k, "pass_at_k": summary["accuracy"], "se": summary["se"], "n": summary["n"], "per_task": summary["per_task"]}  # fmt: skip


def paired_difference(after: Sequence[float | None], before: Sequence[float | None]) -> tuple[float, float, int]:
    """(mean of after - before, its SE, n) over the prompts both judged: the same prompts, so paired."""
    differences = [a - b for a, b in zip(after, before) if a is not None and b is not None]
    mean, se = mean_and_se(differences)
    return mean, se, len(differences)


def verdict(difference: float, se: float) -> str:
    """'gain' or 'loss' only beyond 2 standard errors; otherwise 'no clear difference'."""
    if math.isnan(difference) or math.isnan(se):
        return "not measured"
    if difference > 2 * se:
        return "gain"
    if difference < -2 * se:
        return "loss"
    return "no clear difference"


# ---- what a model costs: KL to the reference on its own samples ----


class SampledKL:
    """KL(policy || ``reference``) per response, estimated on the policy's own samples at temperature 1: the mean over
    samples of the summed log-ratio of the sampled tokens, an unbiased estimate of the sequence-level KL. Passed as
    ``sample_answers``'s ``on_batch``, it scores the samples an evaluation draws anyway (no sampling pass of its
    own); ``value`` is the estimate (nan before any sample)."""

    def __init__(self, reference: nn.Module, tokenizer) -> None:
        self.reference, self.pad_id, self.totals = reference, tokenizer.pad_id, []

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], out: GenerationOutput) -> None:
        device = next(self.reference.parameters()).device
        prompt_ids, prompt_real = left_pad(prompts, self.pad_id, device)
        mask = out.mask.to(device)
        input_ids = torch.cat([prompt_ids, out.tokens.to(device)], dim=1)
        real = torch.cat([prompt_real, mask], dim=1)
        ref_logp = response_logprobs(self.reference, input_ids, real, prompt_ids.shape[1], 1.0, shared_prefix_length(prompts))[0]  # fmt: skip
        self.totals.extend(((out.logprobs.to(device) - ref_logp) * mask).sum(1).tolist())

    @property
    def value(self) -> float:
        return sum(self.totals) / len(self.totals) if self.totals else float("nan")


# ---- held-out prompts never trained on ----


def check_disjoint(train: Sequence[dict[str, Any]], heldout: Sequence[dict[str, Any]], key: str) -> None:
    """Refuse, before any compute, held-out prompts that also appear among the training prompts (same tokens):
    a score on them would measure memory, not generalisation. The error names the first one and ``key``."""
    seen = {tuple(p["prompt_ids"]) for p in train}
    overlap = [p for p in heldout if tuple(p["prompt_ids"]) in seen]
    if overlap:
        first = overlap[0].get("where", "?")
        raise DataError(
            f"{key}: {len(overlap)} of {len(heldout)} held-out prompts also appear in the training prompts "
            f"(first: {first}); held-out prompts must be disjoint from every training prompt"
        )
