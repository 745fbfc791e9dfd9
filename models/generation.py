"""Batched generation with a KV cache (greedy, temperature, top-k, top-p) over left-padded prompts, and the
log-probs a training pass recomputes. Why it pads, decodes and scores as it does: docs/generation.md."""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from models import fast_decode
from models.attention import KVCache, use_flex_attention
from models.model import ModelConfig, Transformer
from models.prefill import last_logits, prefill
from models.prefix_cache import PrefixCache, prefill_from_kept
from models.sampling import GenerationOutput, pick_next, sampling_draws, scaled_logprobs

PAD_DOCUMENT, REAL_DOCUMENT = 0, 1
DECODE_CHOICES = ("auto", "eager", "static", "compiled")
AUTO_DECODE = {"cuda": "compiled"}  # device type -> what decode="auto" runs there; any other device: eager
# the eager loop takes stopped rows out of the batch once at least 1 in COMPACT_WHEN_STOPPED of its rows has stopped:
# each step then computes fewer rows, for one copy of the KV cache's remaining rows (docs/generation.md)
COMPACT_WHEN_STOPPED = COMPACT_DEFAULT = 4
FLEX_LENGTH_BUCKET = 128  # full-sequence passes under FlexAttention: row lengths rounded up to a multiple of this


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Left-pad prompts into (B, T) token ids plus a (B, T) bool mask that is True on real tokens."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    real = torch.zeros((len(prompts), width), dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=device)
            real[row, width - len(prompt) :] = True
    return input_ids, real


def ids_and_positions(real: Tensor) -> tuple[Tensor, Tensor]:
    """Document ids (0 on padding, 1 on real tokens) and position ids (0, 1, 2 ... from each row's first real token).

    Pad positions get position 0 (the clamp); they only ever attend other pads, so their value is irrelevant.
    """
    document_ids = real.long() * REAL_DOCUMENT
    position_ids = (real.long().cumsum(dim=1) - 1).clamp(min=0)
    return document_ids, position_ids


def flex_bucketed(config: ModelConfig | None, input_ids: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """Rows (B, T) right-padded to a multiple of ``FLEX_LENGTH_BUCKET`` (at most ``max_seq_len``) when a pass over
    them runs FlexAttention, so its compiled kernel sees few lengths; the padding is not real, callers cut it back."""
    width = input_ids.shape[1]
    if config is None or not use_flex_attention(config, real, None):
        return input_ids, real
    bucket = min(-(-width // FLEX_LENGTH_BUCKET) * FLEX_LENGTH_BUCKET, config.max_seq_len)
    if bucket <= width:
        return input_ids, real
    return F.pad(input_ids, (0, bucket - width), value=0), F.pad(real, (0, bucket - width), value=False)


def sequence_logprobs(
    model: Transformer,
    input_ids: Tensor,
    *,
    real_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Log-prob of token t+1 from the logits at position t: (B, T-1) float32, the alignment PPO trains with.

    Give either ``real_mask`` (B, T) bool, True on real tokens of a left-padded batch (document and position ids
    are derived exactly as ``generate`` does), or explicit ``document_ids``/``position_ids``, or neither (plain
    causal rows). ``temperature`` 0 means greedy generation and is scored at temperature 1, like ``generate``.
    Runs with whatever grad mode the caller is in (a PPO step needs gradients), and does not touch train/eval.
    Entries whose target token is padding are meaningless; mask them with ``real_mask[:, 1:]``.
    """
    if real_mask is not None:
        if document_ids is not None or position_ids is not None:
            raise ValueError("pass either real_mask or document_ids/position_ids, not both")
        document_ids, position_ids = ids_and_positions(real_mask.bool())
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    logits = model(input_ids, position_ids=position_ids, document_ids=document_ids)[:, :-1]
    return scaled_logprobs(logits, temperature).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def resolve_decode(decode: str, device: torch.device | str) -> str:
    """``decode`` with ``auto`` made concrete for ``device``: ``AUTO_DECODE`` (compiled on CUDA), else eager."""
    if decode not in DECODE_CHOICES:
        raise ValueError(f"decode must be one of {DECODE_CHOICES}, got {decode!r}")
    if decode != "auto":
        return decode
    return AUTO_DECODE.get(torch.device(device).type, "eager")


def _as_prompt_list(prompts: list[list[int]] | Tensor) -> list[list[int]]:
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(f"prompt tensor must be (T,) or (B, T), got shape {tuple(prompts.shape)}")
        if prompts.is_floating_point() or prompts.is_complex():
            raise ValueError(f"prompt tensor must hold integer token ids, got {prompts.dtype}")
        return prompts.tolist()
    return [_as_ids(p, f"prompt {row}") for row, p in enumerate(prompts)]


def _as_ids(values: Iterable[int], what: str) -> list[int]:
    """Plain Python ints; operator.index accepts numpy/torch integers but rejects floats and strings."""
    try:
        return [operator.index(v) for v in values]
    except TypeError as error:
        raise ValueError(f"{what} must hold integer token ids: {error}") from None


def _validate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    stop_ids: list[int],
    pad_id: int,
) -> None:
    config = model.config
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    for row, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {row} is empty: every prompt needs at least one token")
        for token in prompt:
            if not 0 <= token < config.vocab_size:
                raise ValueError(
                    f"prompt {row} holds token id {token}, outside the vocabulary [0, {config.vocab_size})"
                )
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds max_seq_len {config.max_seq_len}"
        )
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    for token in [*stop_ids, pad_id]:
        if not 0 <= token < config.vocab_size:
            raise ValueError(f"stop/pad id {token} is outside the vocabulary [0, {config.vocab_size})")


def _validate_fast_path(
    model: Transformer, batch: int, first_token_mask: Tensor | None, use_cache: bool, static: bool
) -> None:
    if static and not use_cache:
        raise ValueError(
            "static_cache/compile (decode static/compiled) need use_cache=True: they are KV-cache decoding"
        )
    if first_token_mask is not None:
        shape = (batch, model.config.vocab_size)
        if first_token_mask.dtype != torch.bool or tuple(first_token_mask.shape) != shape:
            raise ValueError(
                f"first_token_mask must be a bool tensor of shape {shape}, got {first_token_mask.dtype} {tuple(first_token_mask.shape)}"
            )
        if not bool(first_token_mask.any(dim=1).all()):
            raise ValueError(
                "first_token_mask allows no token for some row: every row needs at least one allowed token"
            )


def generate(
    model: Transformer,
    prompts: list[list[int]] | Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Iterable[int] = (),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    first_token_mask: Tensor | None = None,
    static_cache: bool = False,
    compile: bool = False,
    decode: str = "auto",
    stop_when: Callable[[Tensor], Tensor] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    prompts: a list of token-id lists (any lengths; left-padded into one batch), or a (B, T) / (T,) tensor whose
        tokens are all real. temperature 0 is greedy; top_k / top_p filter the sampling distribution (ignored by
        greedy). A row stops after emitting any id in ``stop_ids`` (the stop token is kept, mask True); from then
        on it yields ``pad_id`` with mask False. The loop ends once every row has stopped.

    Log-probs: ``log_softmax(logits / temperature)`` at the sampled token, computed before top-k/top-p filtering
    (the filtered distribution is only used to draw the sample); greedy uses ``log_softmax(logits)``. A training
    pass recomputes the same numbers with ``sequence_logprobs(..., temperature=temperature)``.

    use_cache=False recomputes the full sequence every step (the reference path, same masking and positions).
    decode: ``eager``, ``static`` (a fixed-size, reused KV cache, one step that decodes and samples:
    ``models.fast_decode``), ``compiled`` (that step under torch.compile "reduce-overhead": CUDA graphs on CUDA), or
    ``auto``: compiled on CUDA, eager elsewhere (``AUTO_DECODE``; on CPU the eager path is the fast one).
    static_cache=True means decode="static" and compile=True decode="compiled" (explicit switches that win over
    ``decode``). All give the eager path's tokens (greedy: identical; sampled: the same draws of the generator).
    A model whose weights are still FSDP2-sharded decodes eagerly (gather them first:
    ``trainer.parallel.unsharded_for_generation``).
    first_token_mask: (B, V) bool, True where a row's FIRST new token is allowed (token healing); other tokens
    get logit -inf at that step, so log-probs of the first token are those of the constrained distribution.
    stop_when: called after each eager step with the tokens so far (B, steps); rows where it returns True stop as
    after a stop id (e.g. a stop string in the text: the harness's ``until``). Static and compiled decoding ignore it.
    prefix_cache: keeps the prompts' keys and values for the next call with this cache, whose prompts that extend
    one of these prefill only their new tokens (a multi-turn episode's turns: ``models.prefix_cache``).
    Runs under ``torch.inference_mode()`` with the model in eval mode; its previous train/eval mode is restored.
    """
    prompts = _as_prompt_list(prompts)
    stop_ids = _as_ids(stop_ids, "stop_ids")
    pad_id = _as_ids([pad_id], "pad_id")[0]
    _validate(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids, pad_id)
    explicit = "compiled" if compile else "static" if static_cache else decode
    mode = resolve_decode(explicit, model.tok_embeddings.weight.device)
    _validate_fast_path(model, len(prompts), first_token_mask, use_cache, explicit in ("static", "compiled"))
    if not use_cache:
        mode = "recompute"

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            out = _generate(
                model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids, pad_id, generator, mode,
                first_token_mask, warn=explicit != "auto", stop_when=stop_when, prefix_cache=prefix_cache,
            )  # fmt: skip
    finally:
        model.train(was_training)
    # Clone outside inference mode: inference tensors cannot be saved for backward, and PPO builds its loss
    # from these (old log-probs, masks).
    return GenerationOutput(*(t.clone() for t in (out.tokens, out.mask, out.logprobs, out.lengths)))


def complete(
    model: Transformer,
    tokenizer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    heal: bool = False,
    compile: bool = False,
    decode: str = "auto",
) -> str:
    """The decoded continuation of one encoded prompt, stopped at and without the tokenizer's stop token
    (``lantern generate``, the end-of-pretraining sample). ``tokenizer`` gives stop_ids, pad_id and decode.

    heal=True applies token healing (``tokenizer.heal_prompt``): the first new token must start with the bytes
    backed off the prompt, and those bytes are cut from the result, so it continues the ORIGINAL prompt text.
    """
    removed = b""
    first_token_mask = None
    if heal:
        prompt, removed, allowed = tokenizer.heal_prompt(prompt)
        if removed:
            first_token_mask = torch.zeros((1, model.config.vocab_size), dtype=torch.bool)
            first_token_mask[0, allowed] = True
    out = generate(
        model,
        [prompt],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        generator=generator,
        first_token_mask=first_token_mask,
        compile=compile,
        decode=decode,
    )
    new_tokens = out.tokens[0][out.mask[0]].tolist()
    if new_tokens and new_tokens[-1] in tokenizer.stop_ids:  # a row ends at its first stop token
        new_tokens = new_tokens[:-1]
    if not removed:
        return tokenizer.decode(new_tokens)
    # Cut in bytes, not characters: the removed bytes may end inside a multi-byte character.
    text = tokenizer.decode_bytes(new_tokens)
    return text[len(removed) :].decode("utf-8", errors="replace")


def _generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    stop_ids: list[int],
    pad_id: int,
    generator: torch.Generator | None,
    mode: str,
    first_token_mask: Tensor | None = None,
    warn: bool = False,
    stop_when: Callable[[Tensor], Tensor] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> GenerationOutput:
    """``mode``: recompute, eager, static or compiled (``resolve_decode``)."""
    device = model.tok_embeddings.weight.device
    input_ids, real = left_pad(prompts, pad_id, device)
    document_ids, position_ids = ids_and_positions(real)
    batch, prompt_width = input_ids.shape
    n_real = real.sum(dim=1)  # real prompt tokens per row: the position of the first generated token
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)

    # The blocks without the wrappers training put around them (None while FSDP2 holds the weights sharded). Both
    # the KV-cache prefill and every decode step run them: through torch.compile'd blocks each new prompt width and
    # cache length would recompile them.
    blocks = fast_decode.decode_blocks(model) if mode != "recompute" else None
    if mode in ("static", "compiled") and blocks is None:
        if warn:
            warnings.warn(
                f"decode={mode!r}: the model's weights are sharded (FSDP2), so it decodes eagerly; gather them "
                "first (trainer.parallel.unsharded_for_generation)",
                stacklevel=3,
            )
        mode = "eager"
    mark_static = mode == "compiled" and device.type == "cuda"  # CUDA graphs then need no copies of the cache

    def new_cache(length: int) -> KVCache | None:
        if mode in ("static", "compiled"):
            return fast_decode.static_cache(model, batch, length, mark_static=mark_static)
        return model.new_kv_cache(batch, length) if mode == "eager" else None

    reuse = prefix_cache is not None and mode != "recompute" and PrefixCache.applies(model)
    kept = prefix_cache.lookup(prompts) if reuse else []
    from_kept = None
    if any(hit is not None for hit in kept):  # prompts that extend the last call's: only their new tokens run
        forward = functools.partial(last_logits, blocks=blocks)
        from_kept = prefill_from_kept(model, prompts, kept, new_cache, max_new_tokens, forward)
    if from_kept is not None:
        logits, kv_cache, prompt_width = from_kept
        prefix_cache.count(prompts, kept)
    else:
        kv_cache = new_cache(prompt_width + max_new_tokens - 1)  # the last generated token is never fed back
        if kv_cache is not None:
            logits = prefill(model, prompts, input_ids, position_ids, document_ids, kv_cache, blocks)
        else:
            logits = last_logits(model, input_ids, position_ids=position_ids, document_ids=document_ids)
        if reuse:
            prefix_cache.count(prompts, [None] * len(prompts))
    if reuse:
        prefix_cache.keep(prompts, kv_cache, prompt_width)
    if first_token_mask is not None:
        logits = logits.float().masked_fill(~first_token_mask.to(device), float("-inf"))
    if mode in ("static", "compiled"):
        return fast_decode.static_decode(
            model, blocks, kv_cache, logits, n_real, prompt_width, max_new_tokens, temperature, top_k, top_p, stop,
            pad_id, generator, mode == "compiled", mark_static,
        )  # fmt: skip

    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch, max_new_tokens), dtype=torch.bool, device=device)
    logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    new_document = torch.full((batch, 1), REAL_DOCUMENT, dtype=torch.long, device=device)
    # Rows that stopped leave the batch (``_rows_left``): ``rows`` maps the rows still decoding to their output rows.
    # Each step still draws one uniform for every row of the original batch, so a row's samples are those of the
    # full batch, whichever rows have left.
    rows = torch.arange(batch, device=device)
    draws = None if temperature == 0 else torch.empty((batch, 1), dtype=torch.float64, device=device)

    steps = 0
    for step in range(max_new_tokens):
        row_draws = None if draws is None else sampling_draws(draws, generator)[rows]
        next_token, next_logprob = pick_next(logits, temperature, top_k, top_p, row_draws)
        # Stopped rows not yet out of the batch emit pad_id (mask False, log-prob 0), as the outputs hold already.
        next_token = torch.where(done, pad_id, next_token)
        tokens[rows, step] = next_token
        mask[rows, step] = ~done
        logprobs[rows, step] = torch.where(done, 0.0, next_logprob)
        done = done | torch.isin(next_token, stop)
        if stop_when is not None:
            done = done | stop_when(tokens[:, : step + 1]).to(device)[rows]
        steps = step + 1
        finished = int(done.sum())
        if steps == max_new_tokens or finished == len(done):
            break
        if finished * COMPACT_WHEN_STOPPED >= len(done):
            kept = (~done).nonzero().squeeze(1)
            rows, done, n_real, next_token = rows[kept], done[kept], n_real[kept], next_token[kept]
            new_document = new_document[: len(kept)]
            if kv_cache is not None:
                kv_cache.keep_rows(kept)
            else:
                input_ids, document_ids, position_ids = input_ids[kept], document_ids[kept], position_ids[kept]

        # Feed the token back: it is real (document 1) at position = real tokens before it. Stopped rows still in
        # the batch feed pads the same way; their outputs are discarded, so what they attend to does not matter.
        next_position = (n_real + step)[:, None]
        if kv_cache is not None:
            logits = last_logits(
                model, next_token[:, None], blocks, position_ids=next_position, document_ids=new_document,
                kv_cache=kv_cache,
            )  # fmt: skip
        else:
            input_ids = torch.cat([input_ids, next_token[:, None]], dim=1)
            document_ids = torch.cat([document_ids, new_document], dim=1)
            position_ids = torch.cat([position_ids, next_position], dim=1)
            logits = last_logits(model, input_ids, position_ids=position_ids, document_ids=document_ids)

    mask = mask[:, :steps]
    return GenerationOutput(tokens=tokens[:, :steps], mask=mask, logprobs=logprobs[:, :steps], lengths=mask.sum(dim=1))
