"""Static-shape decoding: the one-token decode step over a fixed-size KV cache, optionally compiled.

Owns the fast path of ``models.generation.generate(static_cache=True / compile=True)``. The eager cached
path reads ``keys[:, :, :length]``, so every step has a new shape and a compiled step would recompile (and
CUDA graphs could not be replayed). Here each step reads the WHOLE preallocated cache and masks the positions
not yet written, so all steps share one shape: ``torch.compile(mode="reduce-overhead")`` turns the step into
a CUDA graph on CUDA. The cache buffers are kept per (model, batch, length bucket) and reused across calls, so
the compiled code and graphs are reused too (PPO rollouts call generate with the same batch every step).

The prefill still runs the model's ordinary forward into the same ``KVCache`` buffers (it writes the prompt's
document ids); only decode steps take this path. The mask equals ``models.model.attention_mask`` for a query in
document REAL_DOCUMENT at cache position p: keys at positions <= p that belong to the same document.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from models.model import KVCache, Transformer, rope_cos_sin

REAL_DOCUMENT = 1  # models.generation's id for real tokens (pads are 0)
LENGTH_BUCKET = 128  # cache lengths are rounded up to this so varying prompt widths reuse one compiled step
MAX_CACHES_PER_MODEL = 2  # bounds memory: e.g. the PPO rollout batch and the eval batch

# model -> {(batch, length, dtype, device): KVCache}; weak so a discarded model frees its caches
_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compiled_step: Callable | None = None


class _StepWriter:
    """Duck-types ``KVCache.update`` for ``Attention``: writes one step at a tensor position (no Python int, so
    the step does not specialise on it) and returns the whole buffers, whose unwritten tail the mask hides."""

    def __init__(self, cache: KVCache, cache_position: Tensor) -> None:
        self.cache, self.cache_position = cache, cache_position

    def update(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        self.cache.keys[layer].index_copy_(2, self.cache_position, keys)
        self.cache.values[layer].index_copy_(2, self.cache_position, values)
        return self.cache.keys[layer], self.cache.values[layer]


def decode_step(model: Transformer, cache: KVCache, token: Tensor, position: Tensor, cache_position: Tensor) -> Tensor:
    """Last-position logits (B, V) for one new token per row.

    token (B, 1) ids, position (B, 1) RoPE positions, cache_position (1,) long: the cache slot written, the same
    for every row (rows are left-padded, so they advance together). The new token is real (document 1).
    """
    cache.document_ids.index_fill_(1, cache_position, REAL_DOCUMENT)
    key_position = torch.arange(cache.max_len, device=token.device)
    visible = (key_position <= cache_position)[None, :] & (cache.document_ids == REAL_DOCUMENT)  # (B, S)
    mask = visible[:, None, None, :]  # (B, 1, T=1, S)
    cos, sin = rope_cos_sin(model.config, position)
    x = model.tok_embeddings(token)
    writer = _StepWriter(cache, cache_position)
    for layer in model.layers:
        x = layer(x, cos, sin, mask, writer)
    return model.logits(model.norm(x)[:, -1])


def compiled_decode_step() -> Callable:
    """``decode_step`` under torch.compile(mode="reduce-overhead"), built once (CUDA graphs on CUDA)."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    return _compiled_step


def static_cache(model: Transformer, batch: int, length: int, *, mark_static: bool) -> KVCache:
    """A reset KV cache of at least ``length`` positions, reused across calls with the same batch and bucket.

    ``mark_static`` tells torch.compile the buffers keep their addresses (CUDA graphs then need no copies).
    Stale keys/values past the prompt need no clearing: document ids are reset to -1, so the mask hides them.
    """
    bucket = min(-(-length // LENGTH_BUCKET) * LENGTH_BUCKET, model.config.max_seq_len)
    weight = model.tok_embeddings.weight
    key = (batch, bucket, weight.dtype, weight.device)
    per_model = _caches.setdefault(model, {})
    cache = per_model.pop(key, None)
    if cache is None:
        while len(per_model) >= MAX_CACHES_PER_MODEL:
            per_model.pop(next(iter(per_model)))  # the least recently used
        cache = model.new_kv_cache(batch, bucket)
        if mark_static:
            for tensor in (*cache.keys, *cache.values, cache.document_ids):
                torch._dynamo.mark_static_address(tensor)
    per_model[key] = cache  # (re)inserted last: most recently used
    cache.length = 0
    cache.document_ids.fill_(-1)
    return cache
