"""Greedy answers to chat prompts, and exact-match scoring: SFT validation, PPO evaluation and the pipeline
report all measure models this one way."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.generation import generate
from trainer.parallel import unsharded_for_generation


def answer_prompts(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    batch_size: int = 16,
) -> list[str]:
    """Greedy answers (decoded, end-of-turn removed) to already-encoded chat prompts, batched by length.

    ``max_new_tokens`` may differ per prompt (e.g. the reference length plus a margin); a batch runs to the
    largest of its members and each answer is then cut to its own budget.
    """
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths: little padding
    answers: list[str] = [""] * len(prompts)
    with unsharded_for_generation(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            out = generate(
                model,
                [list(prompts[i]) for i in chunk],
                max_new_tokens=max(budgets[i] for i in chunk),
                temperature=0.0,
                stop_ids=tokenizer.stop_ids,
                pad_id=tokenizer.pad_id,
            )
            for row, index in enumerate(chunk):
                tokens = out.tokens[row][out.mask[row]].tolist()[: budgets[index]]
                answers[index] = tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids])
    return answers


def exact_match(answer: str, reference: str) -> bool:
    return answer.strip() == reference.strip()


@torch.no_grad()
def accuracy(answers: Sequence[str], references: Sequence[str]) -> float:
    if not references:
        return float("nan")
    return sum(exact_match(a, r) for a, r in zip(answers, references)) / len(references)
