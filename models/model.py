"""The Llama 3 decoder: one readable file, a dataclass config, no framework magic.

Parameter names follow Meta's reference implementation (``tok_embeddings``, ``layers.N.attention.wq`` ...), so Meta
checkpoints load without renaming. RoPE rotates interleaved pairs (Meta's convention). The same module is Hugging
Face's Llama, Mistral, Qwen2 (``qkv_bias``) and Qwen3 (``qk_norm``), the families of models/families.py. ``document_ids`` (B, T) keep attention and positions inside each
document of a packed row (left padding is one more document).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from models.attention import (
    KVCache,
    attention_mask,
    document_block_mask,
    flex_attention_kernel,
    positions_from_documents,
    use_flex_attention,
)
from models.config_checks import bounded, read_yaml
from models.families import HF_ARCHITECTURES, family_of
from models.loss import cross_entropy, fused_linear_cross_entropy
from models.resources import model_preset_path, model_presets
from models.rope import ROPE_SCALINGS, RopeScaling, apply_rope, rope_cos_sin, rope_frequencies

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

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


@dataclass
class ModelConfig:
    # sizes bounded far past any model trained (Llama 3.1 405B: 126 layers, dim 16384): a value past them is a typo
    dim: int = bounded(256, ge=1, le=2**20)
    n_layers: int = bounded(4, ge=1, le=1024)
    n_heads: int = bounded(8, ge=1, le=2**14)
    n_kv_heads: int | None = bounded(None, ge=1, le=2**14)  # None: same as n_heads (plain multi-head attention)
    # None: dim // n_heads; set when the heads are not dim wide (Mistral Nemo: 128 for dim 5120 / 32 heads). Kept
    # None when derived, so a config merged over the defaults never inherits a stale value.
    head_dim_override: int | None = bounded(None, ge=1, le=2**14)
    vocab_size: int = bounded(4096, ge=1, le=2**24)
    multiple_of: int = bounded(256, ge=1, le=2**20)  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = bounded(None, gt=0, le=256)
    ffn_hidden_dim: int | None = bounded(None, ge=1, le=2**22)  # explicit hidden size; overrides the rule above
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = bounded(2048, ge=1, le=2**24)
    tie_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False  # biases on wq / wk / wv, none on wo (Qwen2)
    logit_softcap: float | None = None
    # auto: FlexAttention on CUDA when documents are masked, SDPA otherwise (CPU, plain causal, KV-cache decoding)
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    hf_architecture: str = "LlamaForCausalLM"  # the Hugging Face family exported to, one of HF_ARCHITECTURES

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        positive = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        override = self.head_dim_override
        if override is not None and (not isinstance(override, int) or override <= 0 or override % 2):
            raise ValueError(f"ModelConfig.head_dim_override must be a positive even integer (RoPE), got {override!r}")
        if override is not None and override * self.n_heads == self.dim:
            self.head_dim_override = None  # the derived value: kept unset, so equal configs compare equal
        if self.head_dim_override is None and self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.dim / n_heads = {self.head_dim} must be even for RoPE")
        if self.norm_eps <= 0:
            raise ValueError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(f"ModelConfig.ffn_dim_multiplier must be > 0, got {self.ffn_dim_multiplier}")
        if self.ffn_hidden_dim is not None and self.ffn_hidden_dim <= 0:
            raise ValueError(f"ModelConfig.ffn_hidden_dim must be > 0, got {self.ffn_hidden_dim}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"ModelConfig.logit_softcap must be > 0, got {self.logit_softcap}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"ModelConfig.attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        problem = self.rope_scaling.problem() if self.rope_scaling is not None else None
        if problem:
            raise ValueError(f"ModelConfig.rope_scaling {problem}")
        if self.hf_architecture not in HF_ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.hf_architecture must be one of {HF_ARCHITECTURES}, got {self.hf_architecture!r}"
            )
        if family_of(self.hf_architecture).qk_norm and not self.qk_norm:
            raise ValueError(
                f"ModelConfig.qk_norm must be true for hf_architecture {self.hf_architecture}: every block of that "
                "family normalises its query and key heads"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``head_dim_override``, else dim // n_heads."""
        return self.head_dim_override if self.head_dim_override is not None else self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size, computed exactly as Meta's reference does."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset from ``configs/model/NAME.yaml`` (or a path to such a YAML file)."""
        path = model_preset_path(name)
        if not path.is_file():
            raise FileNotFoundError(f"no model preset {name!r} (looked for {path}); presets: {model_presets()}")
        values = OmegaConf.to_container(read_yaml(path), resolve=True)  # a duplicate key: one line naming it
        values.update(overrides)
        return cls.from_dict(values)

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
        ffn = 3 * self.dim * self.hidden_dim
        norms = 2 * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + ffn + norms) + self.dim + embeddings

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x matmul weights + attention's 12·L·d·T (PaLM, app. B),
        d being the query width n_heads·head_dim (dim unless ``head_dim_override``).

        The embedding lookup is no matmul; the output projection is, tied or not.
        """
        matmul_params = self.num_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        return 6 * matmul_params + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 for bf16 stability, as Meta's reference does; one fp32 copy of a bf16 x, which autograd
        # keeps for the backward (x.float() twice made two: a seventh of a bf16 Llama-3-8B block's saved activations).
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None

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
            out = flex_attention_kernel(q, k, v, mask, gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One pre-norm block; its own module so FSDP2 and activation checkpointing can wrap it alone."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | BlockMask | None, kv_cache: KVCache | None = None
    ) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, kv_cache, self.layer_index)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
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
        if query_key_mask is not None:
            mask = query_key_mask
        elif use_flex_attention(self.config, document_ids, kv_cache):
            if input_ids.device.type == "cpu" and torch.is_grad_enabled() and self.tok_embeddings.weight.requires_grad:
                raise ValueError(
                    "ModelConfig.attention='flex' has no backward on CPU (torch FlexAttention); use 'auto' or 'sdpa'"
                )
            mask = document_block_mask(document_ids)
        else:
            mask = attention_mask(document_ids, kv_cache, seq_len)
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.length += seq_len
        return self.norm(x)

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
