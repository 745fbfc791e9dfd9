"""Static-shape decoding, the fast path of ``generate`` (``decode="static"`` / ``"compiled"``, and ``"auto"`` on CUDA):
each one-token step reads the whole preallocated KV cache and masks the positions not yet written, so all steps
share one shape and ``torch.compile(mode="reduce-overhead")`` makes the step a CUDA graph. Cache buffers are kept
per (model, batch, length bucket) and reused across calls, so compiled code and graphs are reused too.

Decoding runs the blocks without training's wrappers (``decode_blocks``: compile, activation checkpointing, FSDP2's
hooks, which do nothing once the weights are gathered, and which a ``fullgraph`` trace cannot inline); a model whose
weights are still sharded is not decoded here. The mask equals ``models.model.attention_mask`` for a query at cache
position p: keys at positions <= p of the same document.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without torch.distributed: nothing is sharded (isinstance(x, ()) is False)
    FSDPModule = DTensor = ()

from models.attention import attention_mask, sliding_window_mask
from models.model import KVCache, Transformer, rope_cos_sin
from models.sampling import GenerationOutput, pick_next, sample_next, sampling_draws

REAL_DOCUMENT = 1  # models.generation's id for real tokens (pads are 0)
LENGTH_BUCKET = 128  # cache lengths are rounded up to this so varying prompt widths reuse one compiled step
STOP_CHECK_EVERY = 8  # static / compiled decoding: tokens between two "has every row stopped?" host syncs
# bounds memory: e.g. the rollout batch and the eval batch, each with the smaller batches its stopped rows leave
# (``_without_stopped_rows``: halving buckets, together at most the size of the first)
MAX_CACHES_PER_MODEL = 16

# model -> {(batch, length, dtype, device): KVCache}; weak so a discarded model frees its caches
_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compiled: dict[Callable, Callable] = {}
_over_limit: set[Callable] = set()  # compiled steps that reached the recompile limit (warned once)


class _StepWriter:
    """Duck-types ``KVCache.update`` for ``Attention``: writes one step at a tensor position (no Python int, so
    the step does not specialise on it) and returns the whole buffers, whose unwritten tail the mask hides."""

    def __init__(self, cache: KVCache, cache_position: Tensor) -> None:
        self.cache, self.cache_position = cache, cache_position

    def update(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        self.cache.keys[layer].index_copy_(2, self.cache_position, keys)
        self.cache.values[layer].index_copy_(2, self.cache_position, values)
        return self.cache.keys[layer], self.cache.values[layer]


def _unwrapped(block: nn.Module) -> nn.Module:
    """The module under torch.compile's and activation checkpointing's wrappers (FSDP2 wraps by changing the class
    of the module it shards, so an FSDP2 block is its own unwrapped module)."""
    while True:
        for wrapped in ("_orig_mod", "_checkpoint_wrapped_module"):
            inner = getattr(block, wrapped, None)
            if isinstance(inner, nn.Module):
                block = inner
                break
        else:
            return block


def _input_dtype(block: nn.Module) -> torch.dtype | None:
    """The dtype FSDP2's mixed precision casts a block's floating inputs to (its ``param_dtype``), else None."""
    if not isinstance(block, FSDPModule):
        return None
    policy = block._get_fsdp_state()._mp_policy
    return policy.param_dtype if policy.cast_forward_inputs else None


def decode_blocks(model: Transformer) -> list[tuple[Callable, torch.dtype | None]] | None:
    """The transformer blocks as generation calls them: (a plain block itself, else the ``forward`` of the block
    under its compile / checkpointing wrappers, skipping FSDP2's hooks; the dtype FSDP2 would cast its inputs to).
    None while any weight is sharded (an FSDP2 model outside ``unsharded_for_generation``): only the wrapped forward's
    hooks could gather it, so such a model decodes eagerly through its ordinary forward.
    """
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    blocks: list[tuple[Callable, torch.dtype | None]] = []
    for block in model.layers:
        inner = _unwrapped(block)
        wrapped = inner is not block or isinstance(block, FSDPModule)
        blocks.append((inner.forward if wrapped else block, _input_dtype(block)))
    return blocks


def decode_step(
    model: Transformer,
    blocks: Sequence[tuple[Callable, torch.dtype | None]],
    cache: KVCache,
    token: Tensor,
    position: Tensor,
    cache_position: Tensor,
) -> Tensor:
    """Last-position logits (B, V) for one new token per row.

    blocks: ``decode_blocks(model)``. token (B, 1) ids, position (B, 1) RoPE positions, cache_position (1,) long:
    the cache slot written, the same for every row (rows are left-padded, so they advance together). The new token
    is real (document 1).
    """
    cache.document_ids.index_fill_(1, cache_position, REAL_DOCUMENT)
    key_position = torch.arange(cache.max_len, device=token.device)
    visible = (key_position <= cache_position)[None, :] & (cache.document_ids == REAL_DOCUMENT)  # (B, S)
    mask = visible[:, None, None, :]  # (B, 1, T=1, S)
    cos, sin = rope_cos_sin(model.config, position)
    local = _local(model, position, mask, cache_position, 1, cache.max_len)
    x = _run_blocks(blocks, model.embed(token), cos, sin, mask, _StepWriter(cache, cache_position), local)
    return model.logits(model.norm(x)[:, -1])


def cached_forward(
    model: Transformer,
    blocks: Sequence[tuple[Callable, torch.dtype | None]],
    input_ids: Tensor,
    position_ids: Tensor,
    document_ids: Tensor,
    kv_cache: KVCache,
) -> Tensor:
    """``model.hidden_states`` appending to ``kv_cache`` (the prefill, an eager decode step), with the blocks run as
    ``decode_blocks`` gives them. Through the blocks training compiled, every new prompt width, cache length and layer
    would be a recompile of the block (``fullgraph`` fails at dynamo's recompile limit, the 9th)."""
    seq_len = input_ids.shape[1]
    cos, sin = rope_cos_sin(model.config, position_ids)
    mask = attention_mask(document_ids, kv_cache, seq_len)
    local = _local(model, position_ids, mask, kv_cache.length, seq_len, kv_cache.length + seq_len)
    x = _run_blocks(blocks, model.embed(input_ids), cos, sin, mask, kv_cache, local)
    kv_cache.length += seq_len
    return model.norm(x)


def _local(model: Transformer, positions: Tensor, mask: Tensor, query_start, seq_len: int, key_len: int):
    """The sliding-window layers' cos, sin and mask (as ``Transformer.hidden_states`` makes them), or None."""
    window = model.config.sliding_window
    if window is None:
        return None
    narrowed = sliding_window_mask(mask, window, query_start, seq_len, key_len, positions.device)
    return (*rope_cos_sin(model.config, positions, local=True), narrowed)


def _run_blocks(blocks, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache, local=None) -> Tensor:
    for block, dtype in blocks:
        if dtype is None:
            x = block(x, cos, sin, mask, cache, local)
        else:  # what FSDP2's pre-forward hook does to the inputs under mixed precision
            if local is not None:
                local = (local[0].to(dtype), local[1].to(dtype), local[2])
            x = block(x.to(dtype), cos.to(dtype), sin.to(dtype), mask, cache, local)
    return x


def compiled(step: Callable) -> Callable:
    """``step`` under torch.compile(mode="reduce-overhead", fullgraph=True), built once per function (CUDA graphs
    on CUDA). Each new variant (another model structure, batch, dtype, temperature ...) compiles once more; past
    dynamo's recompile limit, where ``fullgraph`` would fail the run, a call of a variant not compiled yet runs
    ``step`` uncompiled instead (with one warning): the same results, only slower."""
    if step not in _compiled:
        graph = torch.compile(step, mode="reduce-overhead", fullgraph=True)

        def run(*args, **kwargs):
            try:
                return graph(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                if step not in _over_limit:
                    _over_limit.add(step)
                    warnings.warn(
                        f"{step.__name__}: torch.compile's recompile limit reached; variants not compiled so far "
                        "run uncompiled",
                        stacklevel=2,
                    )
                return step(*args, **kwargs)

        _compiled[step] = run
    return _compiled[step]


def compiled_decode_step() -> Callable:
    """``decode_step`` compiled (see ``compiled``)."""
    return compiled(decode_step)


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
    per_model[key] = cache  # (re)inserted last: most recently used
    if mark_static:  # also a cache an uncompiled decode made: a compiled step mutating an unmarked one gets no graph
        for tensor in (*cache.keys, *cache.values, cache.document_ids):
            torch._dynamo.mark_static_address(tensor)
    cache.length = 0
    cache.document_ids.fill_(-1)
    return cache


def decode_and_sample(
    model: Transformer,
    blocks: Sequence,
    cache,
    token: Tensor,
    position: Tensor,
    cache_position: Tensor,
    done: Tensor,
    stop: Tensor,
    draws: Tensor | None,
    pad_id: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One static decode step: feed ``token`` (B, 1) through ``fast_decode.decode_step``, then sample the next
    token as the eager loop does (a stopped row gets ``pad_id``, log-prob 0 and mask False). Returns (next token
    (B,), its log-prob (B,), mask (B,): the row had not stopped, done (B,) after this token)."""
    logits = decode_step(model, blocks, cache, token, position, cache_position)
    next_token, logprob = pick_next(logits, temperature, top_k, top_p, draws)
    next_token = torch.where(done, pad_id, next_token)
    logprob = torch.where(done, 0.0, logprob)
    return next_token, logprob, ~done, done | torch.isin(next_token, stop)


def static_decode(
    model: Transformer,
    blocks: Sequence,
    kv_cache,
    logits: Tensor,
    n_real: Tensor,
    prompt_width: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    stop: Tensor,
    pad_id: int,
    generator: torch.Generator | None,
    compile: bool,
    mark_static: bool = False,
) -> GenerationOutput:
    """The decode loop over ``decode_and_sample`` steps (compiled or not), after the prefill's ``logits``.

    The loop runs no host sync but the stop check every ``STOP_CHECK_EVERY`` tokens; the tokens decoded after every
    row stopped are pads with mask False and are cut at the end, so the output equals the eager loop's (which
    checks after every token). At a check, once the rows still decoding fit a batch of half the size or less, the
    stopped rows leave (``_without_stopped_rows``; batch sizes are powers of two, so a compiled step compiles once per
    size). Only the buffers the step reads are written between steps (no new allocations but at those moves)."""
    batch, device = logits.shape[0], logits.device
    # one output row more than the batch: the sink a smaller batch's padding slots write into (cut at the end)
    tokens = torch.full((batch + 1, max_new_tokens), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch + 1, max_new_tokens), dtype=torch.bool, device=device)
    logprobs = torch.zeros((batch + 1, max_new_tokens), dtype=torch.float32, device=device)
    # the first token comes from the prefill's logits (first_token_mask applied), as in the eager loop
    first, first_logprob = sample_next(logits, temperature, top_k, top_p, generator)
    tokens[:batch, 0], mask[:batch, 0], logprobs[:batch, 0] = first, True, first_logprob
    done = torch.isin(first, stop)
    token = first[:, None].clone()  # the token fed back (B, 1), its RoPE position and its cache slot
    position = n_real[:, None].clone()
    cache_position = torch.full((1,), prompt_width, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # the output row of each row of the batch decoding
    # one uniform per row of the original batch each step, whichever rows have left: a row samples as in the full batch
    all_draws = None if temperature == 0 else torch.empty((batch, 1), dtype=torch.float64, device=device)
    draws = all_draws
    step_fn = compiled(decode_and_sample) if compile else decode_and_sample
    for step in range(1, max_new_tokens):
        if step % STOP_CHECK_EVERY == 0:
            decoding = int((~done).sum())
            if decoding == 0:
                break
            if _batch_size_for(decoding) < len(done):
                kv_cache, token, position, done, rows = _without_stopped_rows(
                    model, kv_cache, token, position, done, rows, sink=batch, mark_static=mark_static
                )
                draws = None if all_draws is None else all_draws.new_empty((len(done), 1))
        if all_draws is not None:
            sampling_draws(all_draws, generator)
            if draws is not all_draws:
                draws.copy_(all_draws[rows.clamp_max(batch - 1)])  # the sink's slots take any: their rows stopped
        if compile:  # the previous step's graph outputs are consumed: let CUDA graphs reuse their memory
            torch.compiler.cudagraph_mark_step_begin()
        next_token, next_logprob, live, done_after = step_fn(
            model, blocks, kv_cache, token, position, cache_position, done, stop, draws, pad_id, temperature, top_k,
            top_p,
        )  # fmt: skip
        tokens[rows, step], logprobs[rows, step], mask[rows, step] = next_token, next_logprob, live
        token.copy_(next_token[:, None])
        done.copy_(done_after)
        position += 1
        cache_position += 1
    tokens, mask, logprobs = tokens[:batch], mask[:batch], logprobs[:batch]
    # the eager loop's length: up to the last token some row still generated (one host sync)
    steps = int((mask.any(dim=0) * torch.arange(1, max_new_tokens + 1, device=device)).max())
    mask = mask[:, :steps]
    return GenerationOutput(tokens=tokens[:, :steps], mask=mask, logprobs=logprobs[:, :steps], lengths=mask.sum(dim=1))


def _batch_size_for(rows: int) -> int:
    """The batch size ``rows`` rows decode in: the next power of two."""
    return 1 << (rows - 1).bit_length()


def _without_stopped_rows(
    model: Transformer, cache: KVCache, token: Tensor, position: Tensor, done: Tensor, rows: Tensor, *, sink: int,
    mark_static: bool,
) -> tuple[KVCache, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The rows still decoding moved into the reused cache of a smaller batch (``_batch_size_for``), padded with
    copies of the first that count as stopped and write their outputs to row ``sink``: (cache, token, position,
    done, rows) of the new batch."""
    kept = (~done).nonzero().squeeze(1)
    size = _batch_size_for(len(kept))
    slots = torch.cat([kept, kept[:1].expand(size - len(kept))])
    padding = torch.arange(size, device=done.device) >= len(kept)
    smaller = static_cache(model, size, cache.max_len, mark_static=mark_static)
    for layer in range(len(cache.keys)):
        smaller.keys[layer].copy_(cache.keys[layer].index_select(0, slots))
        smaller.values[layer].copy_(cache.values[layer].index_select(0, slots))
    smaller.document_ids.copy_(cache.document_ids.index_select(0, slots))
    smaller.length = cache.length
    rows = torch.where(padding, sink, rows[slots])
    return smaller, token[slots].clone(), position[slots].clone(), done[slots] | padding, rows
