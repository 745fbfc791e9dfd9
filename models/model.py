"""The Llama 3 decoder: one readable file, a dataclass config, no framework magic.

Parameter names follow Meta's reference implementation (``tok_embeddings``, ``layers.N.attention.wq`` ...), so Meta
checkpoints load without renaming. RoPE rotates interleaved pairs (Meta's convention). The same module is Hugging
Face's Llama, Mistral, Qwen2 (``qkv_bias``), Qwen3 (``qk_norm``) and Gemma 3 (its block options and sliding-window
layers), the families of models/families.py. ``document_ids`` (B, T) keep attention and positions inside each document
of a packed row (left padding is one more document).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from models.attention import (
    ROPE_SCALINGS,
    KVCache,
    RopeScaling,
    apply_rope,
    attention_mask,
    document_block_mask,
    flex_attention_kernel,
    positions_from_documents,
    rope_cos_sin,
    rope_frequencies,
    sliding_window_mask,
    use_flex_attention,
)
from models.families import HF_ARCHITECTURES
from models.loss import cross_entropy, fused_linear_cross_entropy
from models.model_config import ATTENTION_BACKENDS, ModelConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "HF_ARCHITECTURES",
    "ROPE_SCALINGS",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "apply_rope",
    "rope_cos_sin",
    "rope_frequencies",
]


class RMSNorm(nn.Module):
    """RMSNorm scaling by ``weight`` (Llama) or, with ``offset``, by (1 + weight) in fp32 (Gemma: weights start at 0)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 for bf16 stability, as Meta's reference does; one fp32 copy of a bf16 x, which autograd
        # keeps for the backward (x.float() twice made two: a seventh of a bf16 Llama-3-8B block's saved activations).
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales before casting back, in fp32, as its reference does
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.offset else nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        offset = config.norm_weight_offset
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, offset) if config.qk_norm else None
        self.scale = config.attention_scale_dim**-0.5 if config.attention_scale_dim is not None else None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | BlockMask | None,
        kv_cache: KVCache | None = None,
        layer_index: int = 0,
    ) -> Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_index, k, v)
        gqa = self.n_kv_heads != self.n_heads
        if isinstance(mask, BlockMask):
            out = flex_attention_kernel(q, k, v, mask, gqa, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa, scale=self.scale
            )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

        self.gelu = config.activation == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        gate = F.gelu(self.w1(x), approximate="tanh") if self.gelu else F.silu(self.w1(x))
        return self.w2(gate * self.w3(x))


Local = tuple[Tensor, Tensor, Tensor | BlockMask]  # the sliding-window layers' cos, sin and mask


class TransformerBlock(nn.Module):
    """One pre-norm block (with ``sandwich_norms``, its attention and MLP outputs normed too, as Gemma's); its own
    module so FSDP2 and activation checkpointing can wrap it alone. A local layer takes ``local``'s RoPE and mask."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index, self.is_local = layer_index, config.is_local(layer_index)
        norm = lambda: RMSNorm(config.dim, config.norm_eps, config.norm_weight_offset)  # noqa: E731
        self.attention_norm = norm()
        self.attention = Attention(config)
        self.ffn_norm = norm()
        self.feed_forward = FeedForward(config)
        self.post_attention_norm = norm() if config.sandwich_norms else None
        self.post_ffn_norm = norm() if config.sandwich_norms else None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | BlockMask | None,
        kv_cache: KVCache | None = None,
        local: Local | None = None,
    ) -> Tensor:
        if self.is_local:
            cos, sin, mask = local
        attended = self.attention(self.attention_norm(x), cos, sin, mask, kv_cache, self.layer_index)
        x = x + (self.post_attention_norm(attended) if self.post_attention_norm is not None else attended)
        fed = self.feed_forward(self.ffn_norm(x))
        return x + (self.post_ffn_norm(fed) if self.post_ffn_norm is not None else fed)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_weight_offset)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """std 0.02 everywhere; residual output projections (wo, w2) scaled by 1/sqrt(2·n_layers) (GPT-2); biases 0."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attention.wo", "feed_forward.w2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:  # qkv_bias
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def hidden_states(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        query_key_mask: Tensor | None = None,
    ) -> Tensor:
        """Final-norm hidden states (B, T, dim). The LM head, reward/value heads and chunked loss start here.
        ``query_key_mask`` (B, 1, T, T) bool, True where a query may attend a key, replaces the mask the other
        arguments give (positions then come from ``position_ids``): e.g. choices that share one context."""
        batch, seq_len = input_ids.shape
        start = kv_cache.length if kv_cache is not None else 0
        if start + seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {start + seq_len} tokens exceeds the model's max_seq_len {self.config.max_seq_len}"
            )
        if kv_cache is not None and start + seq_len > kv_cache.max_len:
            raise ValueError(f"sequence of {start + seq_len} tokens exceeds the KV cache length {kv_cache.max_len}")
        if position_ids is None:
            if document_ids is not None and kv_cache is None:
                position_ids = positions_from_documents(document_ids)
            else:
                position_ids = torch.arange(start, start + seq_len, device=input_ids.device).expand(batch, seq_len)
        cos, sin = rope_cos_sin(self.config, position_ids)
        mask: Tensor | BlockMask | None
        flex = query_key_mask is None and use_flex_attention(self.config, document_ids, kv_cache)
        if query_key_mask is not None:
            mask = query_key_mask
        elif flex:
            if input_ids.device.type == "cpu" and torch.is_grad_enabled() and self.tok_embeddings.weight.requires_grad:
                raise ValueError(
                    "ModelConfig.attention='flex' has no backward on CPU (torch FlexAttention); use 'auto' or 'sdpa'"
                )
            mask = document_block_mask(document_ids)
        else:
            mask = attention_mask(document_ids, kv_cache, seq_len)
        local = None
        if self.config.sliding_window is not None:
            window = self.config.sliding_window
            local_mask = (
                document_block_mask(document_ids, window)
                if flex
                else sliding_window_mask(mask, window, start, seq_len, start + seq_len, input_ids.device)
            )
            local = (*rope_cos_sin(self.config, position_ids, local=True), local_mask)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, kv_cache, local)
        if kv_cache is not None:
            kv_cache.length += seq_len
        return self.norm(x)

    def embed(self, input_ids: Tensor) -> Tensor:
        """The input embeddings, times sqrt(dim) with ``embedding_scale`` (Gemma: the factor in their dtype)."""
        x = self.tok_embeddings(input_ids)
        return x * torch.tensor(self.config.dim**0.5, dtype=x.dtype) if self.config.embedding_scale else x

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.output(hidden)
        if self.config.logit_softcap is not None:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        logits_from: int = 0,
        query_key_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T - logits_from, vocab_size) of positions ``logits_from``.. (all by default).

        ``document_ids`` (B, T): tokens attend only within their document; positions restart per document
        unless ``position_ids`` are given. With a ``kv_cache``, the tokens are appended after the cached ones.
        ``logits_from`` skips the LM head where a caller reads no logits (an RL prompt: a sixth of its forward).
        ``query_key_mask``: as ``hidden_states``'s.
        """
        hidden = self.hidden_states(
            input_ids,
            position_ids=position_ids,
            document_ids=document_ids,
            kv_cache=kv_cache,
            query_key_mask=query_key_mask,
        )
        return self.logits(hidden[:, logits_from:] if logits_from else hidden)

    def token_losses(
        self,
        input_ids: Tensor,
        targets: Tensor,
        *,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        z_loss: float = 0.0,
        chunk_size: int | None = 1024,
    ) -> Tensor:
        """Per-token cross entropy (B, T) in fp32, 0 where targets are IGNORE_INDEX (-100).

        With ``chunk_size`` the (B, T, V) logits are never materialised (``fused_linear_cross_entropy``: one chunk
        of logits at a time, recomputed in backward); None computes full logits. Under FSDP2 the training code registers this method as a forward method.
        """
        hidden = self.hidden_states(input_ids, position_ids=position_ids, document_ids=document_ids)
        if chunk_size is None:
            return cross_entropy(self.logits(hidden), targets, z_loss=z_loss, reduction="none")
        return fused_linear_cross_entropy(
            hidden,
            self.output.weight,
            targets,
            chunk_size=chunk_size,
            softcap=self.config.logit_softcap,
            z_loss=z_loss,
            reduction="none",
        )

    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        weight = self.tok_embeddings.weight
        return KVCache(self.config, batch_size, max_len, weight.device, weight.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
