"""Keys and values kept from one ``generate`` call for the next, whose prompts extend the last one's (a multi-turn
episode's next turn: the same tokens, then the policy's turn and the tool's answer). The next prefill then runs
only the new tokens of each row, attending to its kept prefix; what that saves and when it does not apply:
docs/generation.md ("Prompts that extend the last call's").

Layout of a prefill from kept prefixes, per row: ``[hole | kept prefix (L) | hole | new tokens (s)]``, where the kept
prefixes end together at index C and the new tokens at C + S (left-padded within their block, as every row's next
token must go to one cache index). Holes carry the padding document id, so the document-causal mask hides them in
the prefill and in every decode step (eager, static and compiled alike), as it hides a reused static cache's stale
(finite) values past the prompt; positions are each row's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from models.attention import KVCache
from models.model import Transformer

PAD_DOCUMENT, REAL_DOCUMENT = 0, 1


class PrefixCache:
    """Each row's prompt keys and values after a prefill (``keep``), found again by the prompts of a later call that
    start with that row's prompt (``lookup``). A kept prompt that a call extended is dropped when that call keeps its
    own: an episode holds one entry, its last turn's prompt."""

    def __init__(self) -> None:
        self.kept: dict[tuple[int, ...], tuple[list[Tensor], list[Tensor]]] = {}
        self.lengths: list[int] = []  # the kept prompts' lengths, longest first
        self.extended: set[tuple[int, ...]] = set()  # the kept prompts the last lookup found
        self.reused_tokens = 0  # prompt tokens taken from the cache rather than prefilled, over every call
        self.prefilled_tokens = 0

    @staticmethod
    def applies(model: Transformer) -> bool:
        """Whether kept prefixes may be used: a sliding-window layer measures distance in cache indices, which the
        holes of the layout would stretch."""
        return model.config.sliding_window is None

    def lookup(self, prompts: Sequence[Sequence[int]]) -> list[tuple[list[Tensor], list[Tensor]] | None]:
        """For each prompt, the keys and values (per layer, (Hkv, L, D)) of the longest kept prompt it starts with
        and extends by at least one token, or None."""
        found: list[tuple[list[Tensor], list[Tensor]] | None] = []
        for prompt in prompts:
            hit = None
            for length in self.lengths:
                if length < len(prompt) and (hit := self.kept.get(key := tuple(prompt[:length]))) is not None:
                    self.extended.add(key)
                    break
            found.append(hit)
        return found

    def count(self, prompts: Sequence[Sequence[int]], kept: list[tuple[list[Tensor], list[Tensor]] | None]) -> None:
        """Add a call's prompt tokens to ``reused_tokens`` (taken from ``kept``) and ``prefilled_tokens`` (the rest)."""
        reused = sum(hit[0][0].shape[1] for hit in kept if hit is not None)
        self.reused_tokens += reused
        self.prefilled_tokens += sum(len(p) for p in prompts) - reused

    def keep(self, prompts: Sequence[Sequence[int]], cache: KVCache, ends: int) -> None:
        """Keep each row's prompt from ``cache``, whose real prompt tokens end at index ``ends`` in every row, in
        their cache indices (holes skipped), in place of the kept prompts the last lookup found."""
        real = cache.document_ids[:, :ends] == REAL_DOCUMENT
        for key in self.extended:
            self.kept.pop(key, None)
        self.extended = set()
        for row, prompt in enumerate(prompts):
            index = real[row].nonzero().squeeze(1)
            keys = [layer[row].index_select(1, index) for layer in cache.keys]
            values = [layer[row].index_select(1, index) for layer in cache.values]
            self.kept[tuple(prompt)] = (keys, values)
        self.lengths = sorted({len(key) for key in self.kept}, reverse=True)


def prefill_from_kept(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    kept: list[tuple[list[Tensor], list[Tensor]] | None],
    new_cache: Callable[[int], KVCache],
    max_new_tokens: int,
    forward: Callable[..., Tensor],
) -> tuple[Tensor, KVCache, int] | None:
    """The prompts' last-position logits (B, V) from their kept prefixes and a forward over the rest, the cache
    (from ``new_cache(length)``) and the cache index the next token goes to; None when the layout would not fit the
    model's context with ``max_new_tokens`` after it (the caller then prefills as usual). ``forward`` is
    ``prefill.last_logits`` bound to the model's decode blocks."""
    device = model.tok_embeddings.weight.device
    kept_lengths = [0 if hit is None else hit[0][0].shape[1] for hit in kept]
    start = max(kept_lengths)  # C: where every kept prefix ends
    suffixes = [list(p[length:]) for p, length in zip(prompts, kept_lengths)]
    width = max(len(s) for s in suffixes)  # S
    if start + width + max_new_tokens - 1 > model.config.max_seq_len:
        return None
    cache = new_cache(start + width + max_new_tokens - 1)
    cache.document_ids[:, : start + width] = PAD_DOCUMENT
    for row, hit in enumerate(kept):
        if hit is None:
            continue
        first = start - kept_lengths[row]
        for layer, (keys, values) in enumerate(zip(*hit)):
            cache.keys[layer][row, :, first:start] = keys.to(cache.keys[layer].dtype)
            cache.values[layer][row, :, first:start] = values.to(cache.values[layer].dtype)
        cache.document_ids[row, first:start] = REAL_DOCUMENT
    cache.length = start
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    document_ids = torch.full_like(input_ids, PAD_DOCUMENT)
    position_ids = torch.zeros_like(input_ids)
    for row, (suffix, length) in enumerate(zip(suffixes, kept_lengths)):
        first = width - len(suffix)
        input_ids[row, first:] = torch.tensor(suffix, dtype=torch.long, device=device)
        document_ids[row, first:] = REAL_DOCUMENT
        position_ids[row, first:] = torch.arange(length, length + len(suffix), device=device)
    logits = forward(model, input_ids, position_ids=position_ids, document_ids=document_ids, kv_cache=cache)
    return logits, cache, start + width
