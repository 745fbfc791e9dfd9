"""The reward model's data from the policy's own samples: per training prompt, the answer a checker scores best
preferred over the one it scores worst (no pair when all score the same); and the reward model's agreement with the
checker on the policy's samples of held-out prompts (every pair the checker tells apart; a tie in the reward
model's scores counts half), which says whether it can guide RL. Sampling runs in one process.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from typing import Any

import torch

from alignment.schemas.rl import RewardTermConfig
from alignment.shared.rewards import Reward, RewardTerm, build_reward, checker_on_record, load_checker
from alignment.shared.sampling import sample_and_score
from data.records.prompts import PromptDataConfig, load_prompts, record_to_prompt
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError, DataError
from models.files.atomic import write_atomically
from models.formats.checkpoint import load_checkpoint
from models.generation import left_pad


def preference_records(prompts: list[dict[str, Any]], samples: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """One pair per prompt whose K samples score differently: ``{"prompt": messages, "chosen", "rejected", ...}``
    (the reward model's ``pairs`` format), its best answer chosen over its worst."""
    records = []
    for index, prompt in enumerate(prompts):
        group = [s for s in samples[index * k : (index + 1) * k] if s["answer"].strip()]
        if len(group) < 2:
            continue
        best = max(group, key=lambda s: s["score"])
        worst = min(group, key=lambda s: s["score"])
        if best["score"] == worst["score"] or best["answer"].strip() == worst["answer"].strip():
            continue
        messages, _ = record_to_prompt(prompt["record"], PromptDataConfig())
        records.append(
            {
                "prompt": messages, "chosen": best["answer"], "rejected": worst["answer"],
                "chosen_score": best["score"], "rejected_score": worst["score"],
                **{key: prompt["record"][key] for key in ("task", "kind") if key in prompt["record"]},
            }
        )  # fmt: skip
    return records


def agreement(reward_scores: list[float], checker_scores: list[float], k: int) -> tuple[float, int]:
    """(the share of same-prompt sample pairs the checker tells apart that the reward model orders the same way,
    ties counting half; the number of such pairs). Scores are in prompt order, K per prompt."""
    agreed, pairs = 0.0, 0
    for start in range(0, len(checker_scores), k):
        for i, j in combinations(range(start, min(start + k, len(checker_scores))), 2):
            if checker_scores[i] == checker_scores[j]:
                continue
            pairs += 1
            sign = (checker_scores[i] - checker_scores[j]) * (reward_scores[i] - reward_scores[j])
            agreed += 1.0 if sign > 0 else 0.5 if reward_scores[i] == reward_scores[j] else 0.0
    return (agreed / pairs if pairs else float("nan")), pairs


def _policy_samples(config: Any, prompt_files: list[str], tokenizer: Tokenizer, reward: Reward, limit: int) -> tuple:
    samples_config = config.policy_samples
    prompts = load_prompts(PromptDataConfig(tokenizer=config.data.tokenizer), prompt_files, tokenizer)[0]
    if limit:
        prompts = prompts[:limit]
    policy = load_checkpoint(samples_config.policy, dtype=torch.float32).eval()
    samples = sample_and_score(
        policy, tokenizer, reward, prompts, samples_per_prompt=samples_config.samples_per_prompt,
        response_max_tokens=samples_config.response_max_tokens, temperature=samples_config.temperature,
        batch_size=samples_config.batch_size, seed=config.run.seed,
    )  # fmt: skip
    return prompts, samples


def write_policy_pairs(config: Any, run_dir: Path, tokenizer: Tokenizer) -> Path:
    """Sample the policy on ``policy_samples.prompts``, label by ``policy_samples.checker`` and write
    ``policy_pairs.jsonl`` (and its statistics) into ``run_dir``; the path, for ``data.train``."""
    samples_config = config.policy_samples
    checker = load_checker(samples_config.checker, "policy_samples.checker")
    if checker is None or not samples_config.prompts:
        raise ConfigError("policy_samples needs policy_samples.checker and policy_samples.prompts with .policy")
    reward = Reward([RewardTerm(samples_config.checker, 1.0, judge=checker_on_record(checker))])
    prompts, samples = _policy_samples(
        config, list(samples_config.prompts), tokenizer, reward, samples_config.max_prompts
    )
    records = preference_records(prompts, samples, samples_config.samples_per_prompt)
    if not records:
        raise DataError(f"policy_samples: none of {len(prompts)} prompts gave two answers the checker tells apart")
    path = run_dir / "policy_pairs.jsonl"
    write_atomically(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), what="policy pairs")
    stats = {
        "prompts": len(prompts),
        "pairs": len(records),
        "mean_score": sum(s["score"] for s in samples) / len(samples),
    }
    write_atomically(run_dir / "policy_pairs.json", json.dumps(stats, indent=2) + "\n", what="policy pair statistics")
    return path


def measure_agreement(config: Any, run_dir: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """The trained reward model (``run_dir/final``) against the checker on the policy's samples of
    ``policy_samples.heldout`` prompts: written to ``run_dir/policy_agreement.json`` and returned."""
    samples_config = config.policy_samples
    checker = load_checker(samples_config.checker, "policy_samples.checker")
    judge = Reward([RewardTerm(samples_config.checker, 1.0, judge=checker_on_record(checker))])
    prompts, samples = _policy_samples(
        config, list(samples_config.heldout), tokenizer, judge, samples_config.max_prompts
    )
    k = samples_config.samples_per_prompt
    model = build_reward([RewardTermConfig("reward_model", str(run_dir / "final"), 1.0)])
    rows = [
        prompts[i // k]["prompt_ids"] + tokenizer.encode(s["answer"]) + [tokenizer.eot_id]
        for i, s in enumerate(samples)
    ]
    scores: list[float] = []
    for start in range(0, len(rows), samples_config.batch_size):
        input_ids, real = left_pad(rows[start : start + samples_config.batch_size], tokenizer.pad_id)
        scores += model.score([{}] * len(input_ids), [""] * len(input_ids), input_ids, real)[0].tolist()
    share, pairs = agreement(scores, [s["score"] for s in samples], k)
    result = {"agreement": share, "pairs": pairs, "prompts": len(prompts), "samples_per_prompt": k}
    write_atomically(run_dir / "policy_agreement.json", json.dumps(result, indent=2) + "\n", what="agreement")
    return result
