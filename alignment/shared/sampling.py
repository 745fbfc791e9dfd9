"""K sampled responses per prompt, scored by the reward (``sample_and_score``): rejection sampling's candidates and the
reward model's policy pairs. Prompts are batched by length, each sampled K times in one generate call, from one
generator seeded per rank; results come in prompt order (prompt i's samples at i*K .. i*K + K - 1), each with its
answer, total and per-term score, length and whether it ended its turn; ``sample_and_score_episodes`` the same over
multi-turn tool episodes, each with its transcript.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from alignment.shared.episodes import Environment, episode_rows, generate_sampler, run_episodes
from alignment.shared.rewards import Reward
from data.tokenizer.tokenizer import Tokenizer
from models.generation import generate, left_pad


def scored_sample(
    answer: str, total: torch.Tensor, parts: dict[str, torch.Tensor], row: int, tokens: int, ended: bool
) -> dict[str, Any]:
    """One sample as both samplers give it: its answer, the reward's total and per-term scores at ``row``, its
    length in the policy's tokens and whether it ended as it should."""
    return {
        "answer": answer,
        "score": float(total[row]),
        "scores": {name: float(values[row]) for name, values in parts.items()},
        "tokens": tokens,
        "ended": ended,
    }


def sample_and_score(
    policy: torch.nn.Module,
    tokenizer: Tokenizer,
    reward: Reward,
    prompts: list[dict[str, Any]],
    *,
    samples_per_prompt: int,
    response_max_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    batch_size: int = 8,
    seed: int = 0,
    compile: bool = False,
    rank: int = 0,
    decode: str = "auto",
) -> list[dict[str, Any]]:
    """``samples_per_prompt`` samples of each prompt, in prompt order: per sample its answer, score, term scores,
    length and whether it ended with an end of turn. Batches of ``batch_size`` prompts of similar length.
    ``decode``: as ``models.generation.generate`` (auto: the compiled static decode on CUDA, eager on CPU);
    ``compile`` (the SFT trainer's switch) asks for the compiled decode on CUDA, which auto already is."""
    device = next(policy.parameters()).device
    generator = torch.Generator(device).manual_seed(seed + rank)
    k = samples_per_prompt
    samples: list[dict[str, Any]] = [{} for _ in range(len(prompts) * k)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]["prompt_ids"]))
    stops = sorted(tokenizer.stop_ids)
    with tqdm(total=len(prompts), desc="sampling", unit="prompt", disable=rank != 0) as progress:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            rows = [i for i in chunk for _ in range(k)]
            ids = [prompts[i]["prompt_ids"] for i in rows]
            out = generate(
                policy, ids, max_new_tokens=response_max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                stop_ids=stops, pad_id=tokenizer.pad_id, generator=generator,
                decode="compiled" if compile and device.type == "cuda" else decode,
            )  # fmt: skip
            prompt_ids, prompt_real = left_pad(ids, tokenizer.pad_id, device)
            input_ids = torch.cat([prompt_ids, out.tokens.to(device)], dim=1)
            real = torch.cat([prompt_real, out.mask.to(device)], dim=1)
            tokens = [out.tokens[row][out.mask[row]].tolist() for row in range(len(rows))]
            answers = [tokenizer.decode([t for t in row if t not in tokenizer.stop_ids]) for row in tokens]
            total, parts = reward.score([prompts[i] for i in rows], answers, input_ids, real)
            for row, (index, answer) in enumerate(zip(rows, answers)):
                ended = bool(tokens[row]) and tokens[row][-1] in tokenizer.stop_ids
                samples[index * k + row % k] = scored_sample(answer, total, parts, row, len(tokens[row]), ended)
            progress.update(len(chunk))
    return samples


def sample_and_score_episodes(
    policy: torch.nn.Module,
    tokenizer: Tokenizer,
    reward: Reward,
    environment: Environment,
    prompts: list[dict[str, Any]],
    *,
    samples_per_prompt: int,
    turn_tokens: int,
    max_turns: int,
    episode_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    batch_size: int = 8,
    seed: int = 0,
    rank: int = 0,
) -> list[dict[str, Any]]:
    """``sample_and_score``'s samples as tool episodes with ``environment`` (``run_episodes``), in the same order: the
    reward judges each final answer (a reward model the whole episode); each sample also holds its transcript
    (``messages``, the first messages included), turns, tool calls and malformed calls; ``tokens`` counts the
    policy's own tokens and ``ended`` is whether it ended on a final answer."""
    device = next(policy.parameters()).device
    generator = torch.Generator(device).manual_seed(seed + rank)
    environment.rng.seed(seed + rank)
    sample = generate_sampler(policy, tokenizer, generator, temperature=temperature, top_k=top_k, top_p=top_p)
    samples: list[dict[str, Any]] = []
    with tqdm(total=len(prompts), desc="sampling episodes", unit="prompt", disable=rank != 0) as progress:
        for start in range(0, len(prompts), batch_size):
            rows = [prompt for prompt in prompts[start : start + batch_size] for _ in range(samples_per_prompt)]
            played = run_episodes(
                environment, tokenizer, rows, sample, max_turns=max_turns, turn_tokens=turn_tokens,
                episode_tokens=episode_tokens,
            )  # fmt: skip
            input_ids, real, _, _ = episode_rows(played, tokenizer.pad_id)
            answers = [episode.answer for episode in played]
            total, parts = reward.score(rows, answers, input_ids.to(device), real.to(device))
            for row, episode in enumerate(played):
                samples.append(
                    {
                        **scored_sample(
                            episode.answer, total, parts, row, sum(episode.policy), episode.ended == "answer"
                        ),
                        "messages": episode.messages,
                        "turns": episode.turns,
                        "tool_calls": episode.tool_calls,
                        "malformed_calls": episode.malformed_calls,
                    }
                )
            progress.update(len(rows) // samples_per_prompt)
    return samples
