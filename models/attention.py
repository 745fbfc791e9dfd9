"""Attention plumbing the decoder's layers share: the KV cache, the document-causal masks (a dense boolean mask for
SDPA, a BlockMask for FlexAttention), the choice between the two kernels, and positions that restart at each
document. FlexAttention runs document-masked full-sequence passes on CUDA (SDPA cannot use flash with a dense mask),
with one BlockMask per forward shared by every layer; SDPA runs everything else.

And rotary position embeddings: the frequencies (with Llama 3.1's or linear scaling), the per-position cos / sin
tables and the rotation of interleaved pairs (Meta's convention; Hugging Face's rotate-half layout is a wq/wk row
permutation on import and export). ``models.model`` re-exports them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

if TYPE_CHECKING:  # a type only: models.model imports this module
    from models.model import ModelConfig


class KVCache:
    """Pre-allocated keys/values for every layer, plus the document id of every cached position.

    Cached document ids let the same masking rule serve packed rows, left padding and decoding: a query
    attends to a cached key only if both belong to the same document and the key is not in its future.
    """

    def __init__(
        self, config: ModelConfig, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if max_len > config.max_seq_len:
            raise ValueError(f"KV cache length {max_len} exceeds the model's max_seq_len {config.max_seq_len}")
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.document_ids = torch.full((batch_size, max_len), -1, device=device, dtype=torch.long)
        self.max_len = max_len
        self.length = 0  # positions filled so far (the same for every row)

    def keep_rows(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows`` (a 1-D index, in that order): the rows a decode still extends."""
        self.keys = [keys.index_select(0, rows) for keys in self.keys]
        self.values = [values.index_select(0, rows) for values in self.values]
        self.document_ids = self.document_ids.index_select(0, rows)

    def update(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Write (B, Hkv, T, D) keys/values at the current length; return everything cached so far."""
        end = self.length + keys.shape[2]
        self.keys[layer][:, :, self.length : end] = keys
        self.values[layer][:, :, self.length : end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def attention_mask(document_ids: Tensor | None, kv_cache: KVCache | None, seq_len: int) -> Tensor | None:
    """Boolean (B, 1, T, S) mask: causal and within one document. None means plain causal attention.

    Plain causal (no documents, no cache) returns None so SDPA can take its ``is_causal`` fast path.
    """
    if document_ids is None and kv_cache is None:
        return None
    offset = kv_cache.length if kv_cache is not None else 0
    device = document_ids.device if document_ids is not None else kv_cache.document_ids.device
    query_pos = torch.arange(offset, offset + seq_len, device=device)
    key_pos = torch.arange(offset + seq_len, device=device)
    causal = key_pos[None, :] <= query_pos[:, None]  # (T, S)
    if document_ids is None:
        return causal[None, None]
    key_docs = document_ids
    if kv_cache is not None:
        kv_cache.document_ids[:, offset : offset + seq_len] = document_ids
        key_docs = kv_cache.document_ids[:, : offset + seq_len]
    same_doc = document_ids[:, :, None] == key_docs[:, None, :]  # (B, T, S)
    return (causal[None] & same_doc)[:, None]


def sliding_window_mask(
    mask: Tensor | None, window: int, query_start: int | Tensor, seq_len: int, key_len: int, device: torch.device
) -> Tensor:
    """``mask`` ((B or 1, 1, T, S) bool; None: plain causal) narrowed to the keys within ``window`` positions of each
    query: the query at sequence index q (``query_start`` + its row) sees key k only if q - k < window. Within a
    document indices and positions differ by a constant, so the window is the document's last ``window`` tokens."""
    query_pos = torch.arange(seq_len, device=device) + query_start
    key_pos = torch.arange(key_len, device=device)
    distance = query_pos[:, None] - key_pos[None, :]  # (T, S)
    near = distance < window
    if mask is None:
        return (near & (distance >= 0))[None, None]
    return mask & near


def use_flex_attention(config: ModelConfig, document_ids: Tensor | None, kv_cache: KVCache | None) -> bool:
    """Whether this forward runs FlexAttention. Only document-masked full-sequence passes ever do.

    Plain causal attention keeps SDPA's ``is_causal`` flash path (faster than any mask), and KV-cache decoding
    keeps SDPA's dense mask (one query row per step: a block mask would cost more to build than it saves).
    """
    if document_ids is None or kv_cache is not None or config.attention == "sdpa":
        return False
    return config.attention == "flex" or document_ids.device.type == "cuda"


def document_block_mask(document_ids: Tensor, window: int | None = None) -> BlockMask:
    """FlexAttention BlockMask (B, 1, T, T): causal and within one document (and the last ``window`` keys), built once
    a forward and shared by every layer of its kind.

    Building it costs ~10 ms eagerly on an H100 at T=2048, more than one layer's attention, hence once per
    forward; on CUDA the builder is compiled (``block_mask_builder``; fully masked 128x128 blocks are then
    skipped by the kernel).
    """
    batch, seq_len = document_ids.shape

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    def document_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return document_causal(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    build = block_mask_builder(document_ids.device.type)
    rule = document_causal if window is None else document_window
    return build(rule, batch, None, seq_len, seq_len, device=document_ids.device)


_compiled: dict[str, Callable] = {}


def _compiled_on_cuda(device_type: str, name: str, fn: Callable) -> Callable:
    """``fn`` compiled once (lazily) for CUDA, eager elsewhere, and as it is inside a region already being compiled.

    Inside a compiled region (a ``torch.compile``d block or model) dynamo compiles ``fn`` into the surrounding
    graph itself; calling ``torch.compile`` there, or filling the cache, is a graph break dynamo refuses (and an
    unsafe side effect under activation checkpointing), which is what the GPU benchmarks first hit.
    """
    if device_type != "cuda" or torch.compiler.is_compiling():
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=False)
    return _compiled[name]


def block_mask_builder(device_type: str) -> Callable[..., BlockMask]:
    """``create_block_mask``, compiled on CUDA (built once, lazily) and eager elsewhere.

    torch 2.13 deprecates ``create_block_mask(_compile=True)`` in favour of compiling the function itself; on
    CPU compiling would cost the tests far more than the eager build it saves.
    """
    return _compiled_on_cuda(device_type, "create_block_mask", create_block_mask)


def flex_attention_kernel(
    q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, enable_gqa: bool, scale: float | None = None
) -> Tensor:
    """flex_attention, compiled on CUDA (eager flex materialises the scores: correct but slow) and eager on CPU."""
    kernel = _compiled_on_cuda(q.device.type, "flex_attention", flex_attention)
    return kernel(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, scale=scale)


def positions_from_documents(document_ids: Tensor) -> Tensor:
    """Position of each token within its document: 0, 1, 2, ... restarting where the document id changes."""
    batch, seq_len = document_ids.shape
    index = torch.arange(seq_len, device=document_ids.device).expand(batch, seq_len)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


ROPE_SCALINGS = ("llama3", "linear")  # RopeScaling.rope_type values


@dataclass
class RopeScaling:
    """RoPE scaling for a longer context than the model was pretrained on.

    ``rope_type`` "llama3" (the default, so configs written before the field existed read as before): Llama 3.1's
    frequency-dependent scaling, which uses all four numbers. "linear" (transformers' linear scaling): every
    position divided by ``factor`` (inverse frequencies / factor); the other three numbers are unused.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def problem(self) -> str | None:
        """Why this scaling is invalid (for ``ModelConfig``'s message), or None."""
        if self.rope_type not in ROPE_SCALINGS:
            return f"rope_type must be one of {ROPE_SCALINGS}, got {self.rope_type!r}"
        if self.factor < 1:
            return f"needs factor >= 1, got {self}"
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            return f"needs high_freq_factor > low_freq_factor for llama3 scaling, got {self}"
        return None


def rope_frequencies(config: ModelConfig, device: torch.device | None = None, local: bool = False) -> Tensor:
    """Inverse frequencies (head_dim / 2,) in fp32, with Llama 3.1's or linear scaling when configured. ``local``:
    the sliding-window layers', with base ``rope_local_theta`` and unscaled when that is set (Gemma 3)."""
    dim = config.head_dim
    own = local and config.rope_local_theta is not None
    theta = config.rope_local_theta if own else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    scaling = None if own else config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None:
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen < high_wavelen, inv_freq, torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
        )
    return inv_freq.float()


def rope_cos_sin(config: ModelConfig, position_ids: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
    """cos/sin tables (B, T, head_dim / 2) for the given positions, computed in fp32 (``local``: the sliding-window
    layers' RoPE).

    Computed per forward from positions rather than stored as a buffer: it costs B·T·head_dim/2 multiplies,
    stays fp32 whatever precision the module is cast to, and needs no re-init after meta-device construction.
    """
    inv_freq = rope_frequencies(config, position_ids.device, local)
    angles = position_ids.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x (B, T, H, D) by the position angles."""
    x_pairs = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
