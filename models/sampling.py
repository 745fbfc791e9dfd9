"""Choosing the next token: the one place temperature, top-k and top-p are applied, for the eager loop (``sample_next``)
and the static / compiled step (``pick_next``), which pick the very same tokens. ``scaled_logprobs`` gives the
log-probs of ``logits / temperature`` before filtering (what a PPO ratio needs).

A sample is drawn by inverting the cumulative distribution with one uniform per row, not by ``torch.multinomial``,
whose CPU kernel draws one exponential per vocabulary entry: 94 ms a step for 64 rows of SmolLM2's 49,152 tokens on
2 cores, against 33 ms (docs/generation.md, "Drawing a sample").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class GenerationOutput:
    """New tokens only (the prompt is not repeated). N <= max_new_tokens: the loop ends once every row stopped."""

    tokens: Tensor  # (B, N) long; pad_id after a row stopped
    mask: Tensor  # (B, N) bool; True for real generated tokens, the stop token included
    logprobs: Tensor  # (B, N) float32; log-prob of each sampled token (see module docstring), 0 where mask is False
    lengths: Tensor  # (B,) long; number of real generated tokens per row (mask.sum(1))


def scaled_logprobs(logits: Tensor, temperature: float) -> Tensor:
    """``log_softmax(logits / temperature)`` over the vocabulary in fp32; temperature 0 (greedy) is scored at 1.
    The one definition sampling, ``sequence_logprobs`` and RL training (``alignment.shared.losses``) share, so that a
    PPO ratio starts at exactly 1."""
    logits = logits.float()
    return F.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set every token outside the top-k / top-p (nucleus) set to -inf. Applied in that order, as in HF.

    top_k keeps exactly the k largest logits (ties broken by torch.topk). top_p keeps the smallest set of tokens,
    taken in order of decreasing probability, whose cumulative probability reaches top_p; the top-1 always stays.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Probability mass strictly before each token: once it already reaches top_p, the token is not needed.
        # The top-1 has 0 mass before it, so it is always kept (top_p > 0).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Next token (B,) and its log-prob (B,) from last-position logits (B, V); log-prob is pre-filtering."""
    draws = None
    if temperature > 0:
        draws = sampling_draws(logits.new_empty((logits.shape[0], 1), dtype=torch.float64), generator)
    return pick_next(logits, temperature, top_k, top_p, draws)


def sampling_draws(draws: Tensor, generator: torch.Generator | None) -> Tensor:
    """Fill ``draws`` (B, 1) float64 with the uniforms in [0, 1) one sampled token per row takes. Drawn outside the
    compiled step (a graph takes no torch.Generator), so ``pick_next`` given them picks the very tokens
    ``sample_next`` would, and leaves the generator where ``sample_next`` leaves it."""
    return draws.uniform_(0.0, 1.0, generator=generator)


def pick_next(
    logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, draws: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``sample_next`` with its random draws given (``sampling_draws``; None when greedy): what the static /
    compiled decode step samples with."""
    logprobs = scaled_logprobs(logits, temperature)
    if temperature == 0 or draws is None:
        tokens = logits.argmax(dim=-1)
    else:
        probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)
        # the first token whose cumulative probability exceeds u x total: token i is taken with probability
        # probs[i] / total, never a token of probability 0 (right=True skips flat steps of the sum; u < 1 keeps
        # the index inside the vocabulary). In float64, so that 49k+ small terms add up without losing any.
        cumulative = probs.double().cumsum(dim=-1)
        tokens = torch.searchsorted(cumulative, draws * cumulative[:, -1:], right=True).squeeze(-1)
        tokens = tokens.clamp_max(logits.shape[-1] - 1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
