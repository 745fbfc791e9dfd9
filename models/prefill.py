"""The prefill before decoding: the prompts' last-position logits, with the KV cache filled. A prefix every prompt of
the batch starts with (a chat template's system turn; all of it when the batch is one question's samples) runs
once, in one row, and its keys and values are copied into every row: the prefill of SmolLM2's arithmetic prompts
is then 20 tokens a row, not 47. Why and what it saves: docs/generation.md ("A prefix shared by the batch").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from models import fast_decode
from models.attention import KVCache
from models.model import Transformer

SHARED_PREFIX_MIN = 8  # tokens a whole batch must share before the prefix runs once: shorter, the copies cost more


def last_logits(model: Transformer, input_ids: Tensor, blocks: Sequence | None = None, **kwargs) -> Tensor:
    """Logits (B, V) of the last position only: the LM head over the full sequence would be wasted work.
    With ``blocks`` (``fast_decode.decode_blocks``) and a KV cache, the blocks run without their training wrappers."""
    if blocks is not None and kwargs.get("kv_cache") is not None:
        hidden = fast_decode.cached_forward(model, blocks, input_ids, **kwargs)
    else:
        hidden = model.hidden_states(input_ids, **kwargs)
    return model.logits(hidden[:, -1:])[:, 0]


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every prompt has in common, leaving each at least its last token to prefill (its
    logits start the decoding); 0 for a batch of one, which shares its prompt with no other row."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(p) for p in prompts)
    length = 0
    for column in zip(*(p[: shortest - 1] for p in prompts)):
        if any(token != column[0] for token in column):
            break
        length += 1
    return length


def prefill(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    input_ids: Tensor,
    position_ids: Tensor,
    document_ids: Tensor,
    kv_cache: KVCache,
    blocks: Sequence | None = None,
) -> Tensor:
    """The left-padded prompts' (B, T) last-position logits (B, V), with ``kv_cache`` filled for all T positions:
    what one forward over them gives. A prefix of at least ``SHARED_PREFIX_MIN`` tokens that every prompt starts with
    runs once; its keys and values are copied to where each row has it (after the row's padding)."""
    shared = shared_prefix_length(prompts)
    if shared < SHARED_PREFIX_MIN:
        return last_logits(
            model, input_ids, blocks, position_ids=position_ids, document_ids=document_ids, kv_cache=kv_cache
        )
    width, device = input_ids.shape[1], input_ids.device
    pads = [width - len(p) for p in prompts]
    alone = model.new_kv_cache(1, shared)
    prefix = torch.tensor([list(prompts[0][:shared])], dtype=torch.long, device=device)
    last_logits(
        model, prefix, blocks, position_ids=torch.arange(shared, device=device)[None],
        document_ids=torch.ones_like(prefix), kv_cache=alone,
    )  # fmt: skip
    for pad in sorted(set(pads)):  # rows padded alike hold the prefix at the same cache positions
        rows = torch.tensor([row for row, p in enumerate(pads) if p == pad], device=device)
        for layer in range(len(kv_cache.keys)):
            kv_cache.keys[layer][rows, :, pad : pad + shared] = alone.keys[layer][:, :, :shared].to(kv_cache.keys[layer].dtype)  # fmt: skip
            kv_cache.values[layer][rows, :, pad : pad + shared] = alone.values[layer][:, :, :shared].to(kv_cache.values[layer].dtype)  # fmt: skip
    # the rest in one batched forward, from the first position that is not the prefix in every row: a row padded
    # more recomputes the end of its prefix there, which is the same keys and values again
    start = min(pads) + shared
    kv_cache.document_ids[:, :start] = document_ids[:, :start]
    kv_cache.length = start
    return last_logits(
        model, input_ids[:, start:], blocks, position_ids=position_ids[:, start:],
        document_ids=document_ids[:, start:], kv_cache=kv_cache,
    )  # fmt: skip


class _PrefixRow:
    """Stands in for a KV cache in one forward over the prefix (row 0) and every row without it (rows 1..): each
    row's keys and values are the prefix's, read from row 0 inside the same attention call (so the gradients, FSDP2's
    hooks and activation checkpointing's recompute see an ordinary block), then its own."""

    def __init__(self, shared: int, width: int) -> None:
        self.shared, self.length, self.max_len = shared, 0, width

    def update(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        rows, shared = keys.shape[0], self.shared
        return (
            torch.cat([keys[:1, :, :shared].expand(rows, -1, -1, -1), keys], dim=2),
            torch.cat([values[:1, :, :shared].expand(rows, -1, -1, -1), values], dim=2),
        )


def logits_with_shared_prefix(
    model: Transformer, input_ids: Tensor, real: Tensor, shared: int, logits_from: int
) -> Tensor:
    """What ``model(input_ids, ..., logits_from=logits_from)`` gives for left-padded rows (B, T) whose real tokens all
    start with the same ``shared`` tokens (``real`` marks real tokens), the prefix run once: one forward over the
    prefix as an extra row and every row without it. Every row must keep at least one token of its own before
    ``logits_from`` (``shared_prefix_length`` leaves one)."""
    batch, width = input_ids.shape
    device, rest = input_ids.device, width - shared
    wide = max(rest, shared)  # the prefix's row and the others, one width
    pads = (real.long().cumsum(1) == 0).sum(1)  # (B,) left padding of each row
    prefix = input_ids[:1].gather(1, pads[:1, None] + torch.arange(shared, device=device))  # (1, S)
    # each row without its copy of the prefix: its padding, then what follows the prefix; the same width for all
    column = torch.arange(rest, device=device)
    source = column + shared * (column[None] >= pads[:, None])  # (B, T - S)
    own_ids = F.pad(input_ids.gather(1, source), (0, wide - rest))
    own_real = F.pad(real.gather(1, source), (0, wide - rest))
    ids = torch.cat([F.pad(prefix, (0, wide - shared)), own_ids])
    positions = torch.cat([torch.arange(wide, device=device)[None], (own_real.long().cumsum(1) - 1).clamp(min=0) + shared])  # fmt: skip
    # keys: the prefix's `shared`, then the row's own `wide`. Row 0 reads its own causally; the others read all of
    # the prefix, and their own causally within real tokens or within padding, as in the full rows
    causal = torch.ones(wide, wide, dtype=torch.bool, device=device).tril()
    prefix_row = torch.cat([torch.zeros(1, wide, shared, dtype=torch.bool, device=device), causal[None]], dim=2)
    own = causal[None] & (own_real[:, :, None] == own_real[:, None, :])
    rows = torch.cat([torch.ones(batch, wide, shared, dtype=torch.bool, device=device), own], dim=2)
    logits = model(
        ids, position_ids=positions, kv_cache=_PrefixRow(shared, wide),
        query_key_mask=torch.cat([prefix_row, rows])[:, None], logits_from=logits_from - shared,
    )  # fmt: skip
    return logits[1:, : width - logits_from]
