"""What a model costs in memory, counted from the model itself (a meta-device ``Transformer`` or ``ScalarModel``, with
its LoRA adapters when asked, never a formula): parameters, the activations one micro-batch keeps for backward and
the working sets at each moment the peak may fall on, the fused / chunked LM loss, the KV cache, and the full-logits
passes the RL stages score responses with. Bytes under three numerics: ``fp32`` (32-true), ``bf16`` (bf16 weights in
compute) and ``autocast`` (bf16-mixed without FSDP). The tests hold the tally to what autograd really saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from models.model import ModelConfig
from models.parameter_shapes import ParameterShapes, meta_parameters

Numerics = Literal["fp32", "bf16", "autocast"]
AttentionPath = Literal["causal", "dense-mask", "flex"]
NUMERICS = ("fp32", "bf16", "autocast")
GiB = 2**30


def attention_path(config: ModelConfig, *, masked: bool, device: str) -> AttentionPath:
    """Which attention a full-sequence pass runs (as ``use_flex_attention`` chooses): FlexAttention for
    document-masked rows on CUDA (or ``attention: flex``), SDPA with a dense mask for other masked rows, SDPA's causal
    kernel for plain causal rows."""
    if not masked:
        return "causal"
    if config.attention == "flex" or (config.attention == "auto" and device == "cuda"):
        return "flex"
    return "dense-mask"


def numerics_bytes(numerics: Numerics) -> tuple[int, int]:
    """(bytes of the residual stream, bytes of what the matmuls compute in)."""
    return {"fp32": (4, 4), "bf16": (2, 2), "autocast": (4, 2)}[numerics]


def block_saved_bytes(
    config: ModelConfig, batch: int, seq: int, numerics: Numerics, attention: AttentionPath, compiled: bool = False
) -> int:
    """Bytes one transformer block saves for backward without checkpointing (its input counted with it), op by op:
    each RMSNorm its input (an fp32 copy when the stream is bf16), its rsqrt and its normalised output before and
    after the gain; the q/k/v projections their input (under autocast each casts it anew); SDPA q, k, v, its output
    and log-sum-exp (plus the float mask on the dense-mask path); the SwiGLU its two projections, their silu and
    their product. RoPE saves only its cos / sin tables (shared by every block, counted once elsewhere).

    ``compiled`` (``trainer.compile``, one graph a block): inductor's partitioner recomputes the elementwise work in
    backward and keeps the block's input, each matmul's input in the compute dtype (the two norms' outputs, the
    attention output, the SwiGLU product), q, k, v, SDPA's output and log-sum-exp, the SwiGLU's two projections and
    the norms' rsqrt (measured with a saved-tensor hook on CPU, tests/models/test_memory.py)."""
    n, d = batch * seq, config.dim
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim  # q is d unless head_dim_override
    ffn = config.hidden_dim
    residual, compute = numerics_bytes(numerics)
    mask = batch * seq * seq * compute if attention == "dense-mask" else 0  # SDPA's float copy, made by every layer
    norm_count = 4 if config.sandwich_norms else 2
    heads = config.n_heads + config.n_kv_heads
    if compiled:  # QK and sandwich norms: their outputs (matmul or SDPA inputs) and rsqrt kept, the rest recomputed
        lse = 4 * batch * config.n_heads * seq
        extra = (norm_count - 2) * (compute * n * d + 4 * n)
        extra += compute * n * (q + kv) + 4 * n * heads if config.qk_norm else 0
        block = residual * n * d + compute * n * (2 * d + 3 * q + 2 * kv + 3 * ffn) + lse + 2 * 4 * n + mask
        return block + extra
    if numerics == "bf16":  # RMSNorm keeps one fp32 copy of its input; the bf16 input itself is not kept
        norm_input, normed, attn_inputs, ffn_inputs = 4 * n * d, 2 * n * d, 2 * n * d, 2 * n * d
    elif numerics == "autocast":  # fp32 stream; each linear casts its fp32 input to bf16 and keeps the copy
        norm_input, normed, attn_inputs, ffn_inputs = 4 * n * d, 4 * n * d, 3 * 2 * n * d, 2 * 2 * n * d
    else:
        norm_input, normed, attn_inputs, ffn_inputs = 4 * n * d, 4 * n * d, 4 * n * d, 4 * n * d
    if config.norm_weight_offset:  # Gemma's norms scale in fp32: the normalised output kept is fp32 whatever the stream
        normed = 4 * n * d
    # attention_norm and ffn_norm (and with sandwich_norms the attention's and the MLP's outputs), each with its rsqrt
    norms = norm_count * (norm_input + normed + 4 * n)
    if config.qk_norm:  # each query and key head normed: an fp32 copy of its input, its output, its rsqrt
        qk_normed = 4 if config.norm_weight_offset or numerics == "fp32" else 2
        norms += (4 + qk_normed) * n * (q + kv) + 4 * n * heads
    sdpa = compute * (2 * n * q + 2 * n * kv) + 4 * batch * config.n_heads * seq  # q, out, k, v; lse
    return norms + attn_inputs + sdpa + mask + ffn_inputs + 4 * compute * n * ffn


def local_layers(config: ModelConfig) -> int:
    """How many layers attend through the sliding window."""
    return sum(config.is_local(layer) for layer in range(config.n_layers))


@dataclass
class ActivationEstimate:
    """Bytes a micro-batch holds from its forward into its backward (``saved``), and what is live at each moment a
    peak may fall on (``moments``: the saved bytes still held then plus that moment's working set); ``peak`` is the
    largest of them."""

    saved: dict[str, int] = field(default_factory=dict)
    moments: dict[str, int] = field(default_factory=dict)

    @property
    def saved_total(self) -> int:
        return sum(self.saved.values())

    @property
    def peak(self) -> int:
        return max(self.saved_total, *self.moments.values())

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.moments.__getitem__) if self.moments else "end of forward"


def _wrapped_indices(n_layers: int, ac: str, every: int) -> set[int]:
    """The indices of the blocks activation checkpointing wraps (as ``checkpointed_blocks`` counts them)."""
    if ac == "full":
        return set(range(n_layers))
    return set(range(0, n_layers, max(every, 1))) if ac == "selective" else set()


def checkpointed_blocks(n_layers: int, ac: str, every: int) -> int:
    """Blocks activation checkpointing wraps: all (full), every ``every``-th from the
    first (selective), none."""
    return len(_wrapped_indices(n_layers, ac, every))


def activation_bytes(
    config: ModelConfig,
    batch: int,
    seq: int,
    *,
    numerics: Numerics,
    attention: AttentionPath,
    ac: str = "none",
    ac_every: int = 2,
    head: Literal["lm", "scalar"] = "lm",
    chunk_size: int | None = 1024,
    head_trains: bool = True,
    embedding_trains: bool = True,
    params: ParameterShapes | None = None,
    compiled: bool = False,
    z_loss: bool = False,
) -> ActivationEstimate:
    """The activations of one training micro-batch of ``batch`` rows of ``seq`` tokens: the blocks (``ac``: none,
    full, selective every ``ac_every``; a checkpointed block keeps only its input), the masks, the embedding's ids, the
    final norm and the head: the LM loss (``chunk_size``: fused and chunked; None: full logits) or a
    scalar head (reward model, critic). ``head_trains`` / ``embedding_trains``: the LM head's / the embedding's weight
    gets a gradient (not under LoRA). ``params``: the model's (``meta_parameters``), for autocast's weight copies;
    default: the plain model's. ``compiled``: each block compiled (``block_saved_bytes``). ``z_loss``: the loss adds
    PaLM's z-loss (``loss_bytes``).

    Moments a peak may fall on: the loss's forward and backward (the whole saved set still held), the last block's
    backward (or, under checkpointing, the last checkpointed block recomputed: its saved set back, plus the gradient
    flowing into it and the SwiGLU's two input gradients, once the loss, the final norm and the plain blocks behind it
    have let go), and the embedding's backward (its dense weight gradient; with tied embeddings autograd holds the LM
    head's gradient of the same weight from the loss's backward until then, to add the two)."""
    n, d, layers = batch * seq, config.dim, config.n_layers
    residual, compute = numerics_bytes(numerics)
    block = block_saved_bytes(config, batch, seq, numerics, attention, compiled)
    wrapped = checkpointed_blocks(layers, ac, ac_every)
    estimate = ActivationEstimate()
    estimate.saved["blocks"] = (layers - wrapped) * block + wrapped * residual * n * d
    # cos / sin (B, T, head_dim / 2) fp32, shared by every block (the local layers' a second pair); the token ids
    local = local_layers(config)
    estimate.saved["rope, ids"] = 4 * n * config.head_dim * (2 if config.sliding_window is not None else 1) + 8 * n
    if attention == "dense-mask" and wrapped:
        estimate.saved["masks"] = batch * seq * seq  # the boolean (B, 1, T, T) mask a checkpointed block keeps
    if attention == "causal" and local:  # causal rows: the local layers alone take a dense (1, 1, T, T) window mask
        unwrapped_local = sum(
            config.is_local(i) for i in range(layers) if i not in _wrapped_indices(layers, ac, ac_every)
        )
        estimate.saved["masks"] = unwrapped_local * seq * seq * compute + (seq * seq if wrapped else 0)
    if config.norm_weight_offset:  # each norm's fp32 (1 + weight)
        norms = (4 if config.sandwich_norms else 2) * d + (2 * config.head_dim if config.qk_norm else 0)
        estimate.saved["norm gains"] = 4 * (layers * norms + d)
    if numerics == "autocast":  # bf16 copies of the weights of every block whose forward is not recomputed
        params = meta_parameters(config) if params is None else params
        estimate.saved["autocast weight copies"] = (layers - wrapped) * autocast_block_weight_bytes(params)
    final_input = 4 * n * d  # the final norm's fp32 input (a copy of a bf16 stream)
    final_normed = (2 if numerics == "bf16" and not config.norm_weight_offset else 4) * n * d
    estimate.saved["final norm"] = final_input + final_normed + 4 * n
    if head == "scalar":  # the head reads the final norm's output (a bf16 cast of it under autocast)
        estimate.saved["head"] = (2 if numerics == "autocast" else residual) * n * d + 8 * batch
    else:
        saved, working = loss_bytes(
            config, n, numerics=numerics, chunk_size=chunk_size, weight_trains=head_trains, z_loss=z_loss
        )
        estimate.saved["loss"] = saved
        total = estimate.saved_total
        estimate.moments.update({moment: total + extra for moment, extra in working.items()})
    weight = (2 if numerics == "bf16" else 4) * config.vocab_size * d
    held = weight if config.tie_embeddings and head == "lm" and head_trains else 0
    # unchunked, the head's weight gradient is a transposed view autograd cannot add into: the sum is a third copy
    summed = weight if held and chunk_size is None else 0
    released = estimate.saved["final norm"] + estimate.saved.get("loss", 0) + estimate.saved.get("head", 0)
    flowing = 2 * compute * n * config.hidden_dim + residual * n * d
    if wrapped:  # plain blocks behind the last checkpointed one are done, and freed, before its recompute
        last = layers - 1 if ac == "full" else (layers - 1) // ac_every * ac_every
        after = (layers - 1 - last) * block
        recast = autocast_block_weight_bytes(params) if numerics == "autocast" else 0  # autocast casts them again
        estimate.moments["one block recomputed"] = (
            estimate.saved_total - released - after + block + recast + flowing + held
        )
    else:
        estimate.moments["last block backward"] = estimate.saved_total - released + flowing + held
    if embedding_trains:
        estimate.moments["embedding backward"] = 8 * n + weight + held + summed + residual * n * d
    return estimate


def loss_bytes(
    config: ModelConfig,
    tokens: int,
    *,
    numerics: Numerics,
    chunk_size: int | None,
    weight_trains: bool = True,
    z_loss: bool = False,
) -> tuple[int, dict[str, int]]:
    """(bytes the LM loss keeps for backward, its working sets) for ``tokens`` positions.

    Fused and chunked (``fused_linear_cross_entropy``): it keeps the hidden states, the targets, a
    validity mask and each token's fp32 log-sum-exp; its backward holds the fp32 gradient of the head's weight (and
    a compute-dtype copy of the weight under autocast), the hidden states' gradient, and one chunk's fp32 logits and
    softmax gradient at a time (the first of them kept from the forward). Full logits (``chunk_size`` None,
    ``F.cross_entropy``): their fp32 log-softmax is kept; with ``z_loss`` (logsumexp - gather,
    ``models.loss._token_losses``) the fp32 logits themselves."""
    d, vocab = config.dim, config.vocab_size
    residual, compute = numerics_bytes(numerics)
    ids = 8 * tokens + tokens  # the targets (int64) and the valid mask (bool)
    if chunk_size is None:  # the (tokens, V) logits, cast to fp32
        hidden = 2 * tokens * d if numerics == "autocast" else residual * tokens * d
        rows = tokens * vocab
        saved = hidden + 4 * rows + 4 * tokens + ids  # F.cross_entropy's fp32 log-softmax, or z-loss's fp32 logits
        weight_grad = 4 * vocab * d if weight_trains else 0
        forward = compute * rows + (4 * rows if compute != 4 else 0)  # the head's output and its fp32 copy
        if z_loss:  # backward: gather's and logsumexp's gradients, their sum and the exp(logits - lse) behind them;
            # the compute-dtype copy of the sum for the head's matmuls
            backward = 4 * 4 * rows + (compute * rows if compute != 4 else 0)
            return saved, {"loss backward": backward + weight_grad, "loss forward": forward}
        # backward: NLL's dense gradient and log-softmax's, both fp32; then (the log-softmax released) the head's
        # matmuls on the gradient in the compute dtype (a cast of it under bf16), the weight's and the hidden states'
        # gradients
        head = (compute - 4) * rows + weight_grad + residual * tokens * d
        return saved, {"loss backward": 2 * 4 * rows, "head backward": head, "loss forward": forward}
    chunk = min(chunk_size, tokens) * vocab
    cast = numerics == "autocast"  # the Function casts hidden and weight to bf16 itself, in forward and backward
    low = cast or numerics == "bf16"  # the head's matmuls run in bf16
    saved = residual * tokens * d + 4 * tokens + ids  # hidden (the final norm's output), log-sum-exp
    # one chunk at a time: its fp32 logits, logits - lse and their exp (the gradient of the logits, returned in the
    # compute dtype and alive until the next chunk's replaces it); in bf16 the product added into the fp32 weight
    # gradient is a (V, d) bf16 tensor of its own, as is that gradient's cast back at the end
    grad_chunk = (2 if low else 4) * chunk  # a chunk's logit gradient, in the compute dtype
    # the first chunk backward takes (the forward's kept last one) starts the fp32 weight gradient from its product
    # (in bf16: the product, then its fp32 copy); the later ones add theirs into it
    first_product = grad_chunk + (6 if low else 4) * vocab * d if weight_trains else 0
    first = max(3 * 4 * chunk, first_product)
    later = 0
    if tokens > chunk_size:
        product = 2 * chunk + 2 * vocab * d if low and weight_trains else 0
        later = (4 * vocab * d if weight_trains else 0) + grad_chunk + max(3 * 4 * chunk, product)
    backward = (
        (2 * vocab * d + 2 * tokens * d if cast else 0)  # autocast: bf16 copies of the weight and hidden
        + residual * tokens * d  # the hidden states' gradient
        + max(first, later)
    )
    forward = 8 * tokens + 3 * 4 * chunk + (2 * vocab * d + 2 * tokens * d if cast else 0)
    return saved, {"loss backward": backward, "loss forward": forward}


def autocast_block_weight_bytes(params: ParameterShapes) -> int:
    """bf16 copies autocast caches of one block's matrices (its adapters' too), kept for backward (the LM head's
    weight is cast by the fused loss itself, and counted there)."""
    matrices = sum(math.prod(shape) for shape, _, block in params.tensors if block and len(shape) == 2)
    return 2 * matrices // max(params.n_blocks, 1)


def kv_cache_bytes(config: ModelConfig, batch: int, length: int, dtype_bytes: int) -> int:
    """A ``KVCache``: keys and values of every layer, (batch, n_kv_heads, length, head_dim), in the
    weights' dtype, plus an int64 document id per position."""
    per_layer = 2 * batch * config.n_kv_heads * length * config.head_dim * dtype_bytes
    return config.n_layers * per_layer + 8 * batch * length


def inference_bytes(
    config: ModelConfig, batch: int, seq: int, *, numerics: Numerics, attention: AttentionPath,
    head: Literal["lm", "scalar", "last"] = "scalar", chunk_size: int | None = 1024,
) -> int:  # fmt: skip
    """The working set of a forward without gradients (a frozen reference or reward model scoring rows, a critic's
    values, a generation's prefill): the residual stream in and out of a block, one block's intermediates at a time
    (the SwiGLU's three (n, hidden) tensors, or attention's q, k, v, output and mask), then the head's: one chunk's
    logits (``lm``, the fused loss), a score per position (``scalar``) or the last position's logits (``last``)."""
    n, d = batch * seq, config.dim
    residual, compute = numerics_bytes(numerics)
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    mask = batch * seq * seq * (1 + compute) if attention == "dense-mask" else 0
    block = max(3 * compute * n * config.hidden_dim, compute * (n * d + 2 * n * q + 2 * n * kv) + mask)
    heads = {
        "lm": 3 * 4 * min(chunk_size or n, n) * config.vocab_size + 4 * n,
        "scalar": 4 * n,
        "last": 2 * 4 * batch * config.vocab_size,
    }
    return 2 * residual * n * d + compute * n * d + block + heads[head]


def logprob_pass_bytes(
    config: ModelConfig, batch: int, width: int, response: int, *, numerics: Numerics, attention: AttentionPath,
    grad: bool, ac: str = "none", ac_every: int = 2, head_trains: bool = True,
    compiled: bool = False,
) -> ActivationEstimate:  # fmt: skip
    """One ``response_logprobs`` pass over ``batch`` rows of ``width`` tokens
    (prompt + response): the (B, response + 1, V) logits from the last prompt position on (``logits_from``), then the
    fp32 log-softmax, its exp and the entropy of the ``response`` positions. With ``grad`` (the RL training pass) the
    blocks' activations, the log-softmax and its exp are kept, and the backward of the slice makes a zero-filled
    gradient of the logits; without (rollout old log-probs, the reference, evaluation) only the pass's working set
    counts."""
    vocab = config.vocab_size
    rows = batch * response * vocab  # (B, response, V)
    residual, compute = numerics_bytes(numerics)
    logits = compute * batch * (response + 1) * vocab  # the head's output
    upcast = 4 * rows if compute != 4 else 0  # logits.float() of the response positions
    # what the head reads: the final norm's output from the last prompt position on (a copy: a slice of it)
    hidden = (2 if numerics == "autocast" else residual) * batch * (response + 1) * config.dim
    if not grad:
        working = hidden + logits + upcast + 3 * 4 * rows  # log-softmax, then its exp and their product
        return ActivationEstimate(moments={"log-prob pass": working})
    estimate = activation_bytes(
        config, batch, width, numerics=numerics, attention=attention, ac=ac, ac_every=ac_every, head="scalar",
        head_trains=head_trains, compiled=compiled,
    )  # fmt: skip
    estimate.saved["head"] = hidden + 2 * 4 * rows + 8 * batch * response  # + log-softmax and exp; gather's index
    saved = estimate.saved_total
    weight_grad = (2 if numerics == "bf16" else 4) * vocab * config.dim if head_trains else 0
    estimate.moments["log-prob forward"] = saved + logits + max(upcast, 4 * rows)
    # backward: the log-softmax and exp are released, the slice's gradient is a zero-filled (B, width, V) tensor
    estimate.moments["log-prob backward"] = saved - 4 * rows + logits + upcast // 2 + weight_grad
    return estimate
