"""Choosing the next token: the one place temperature, top-k and top-p are applied, for the eager loop (``sample_next``)
and the static / compiled step (``pick_next``), which pick the very same tokens. ``scaled_logprobs`` gives the
log-probs of ``logits / temperature`` before filtering (what a PPO ratio needs).
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
    logprobs = scaled_logprobs(logits, temperature)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def sampling_noise(noise: Tensor, generator: torch.Generator | None) -> Tensor:
    """Fill ``noise`` (B, V) float32 with the Exp(1) draws ``torch.multinomial(probs, 1, generator=generator)`` makes
    for (B, V) probabilities: it samples argmax(probs / noise) (the exponential form of the Gumbel-max trick), so
    ``pick_next`` given these draws picks the very tokens ``sample_next`` would, and leaves the generator where
    ``sample_next`` leaves it. Drawn outside the compiled step (a graph takes no torch.Generator)."""
    return noise.exponential_(1, generator=generator)


def pick_next(
    logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, noise: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``sample_next`` with its random draw given as ``noise`` (``sampling_noise``; None when greedy): what the
    static / compiled decode step samples with."""
    logprobs = scaled_logprobs(logits, temperature)
    if temperature == 0 or noise is None:
        tokens = logits.argmax(dim=-1)
    else:
        probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(dim=-1)
        tokens = (probs / noise).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
