"""``ModelConfig``: the decoder's shape and block options, checked where a config is made, with its presets
(``configs/model/NAME.yaml``) and its parameter and FLOP counts. The families it expresses are models/families.py's.
``PeftConfig``: the ``peft`` section of every fine-tuning stage (LoRA adapters) and the layers it may adapt."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from omegaconf import OmegaConf

from models.attention import RopeScaling
from models.config_checks import bounded, check_config, model_preset_path, model_presets, read_yaml
from models.errors import ConfigError
from models.families import HF_ARCHITECTURES, family_of

__all__ = [
    "ATTENTION_BACKENDS",
    "HF_TARGETS",
    "LORA_TARGETS",
    "InvalidModelConfig",
    "ModelConfig",
    "PeftConfig",
    "adapter_config",
    "lantern_targets",
]

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


class InvalidModelConfig(ValueError):
    """A value of a ModelConfig outside its declared range or choices, or breaking a rule between fields; the message
    names it ``ModelConfig.KEY``, which the place the config entered renames after its own keys."""


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
    norm_eps: float = bounded(1e-5, gt=0)
    rope_theta: float = bounded(500000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = bounded(2048, ge=1, le=2**24)
    tie_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False  # biases on wq / wk / wv, none on wo (Qwen2)
    logit_softcap: float | None = bounded(None, gt=0)
    # Gemma 3's block, each option off for Llama's: embeddings times sqrt(dim); RMSNorm scaling by (1 + weight) in fp32
    # (weights start at 0); a tanh-GELU gate (GeGLU) in place of SwiGLU's SiLU; a second RMSNorm after attention and
    # after the MLP (four a block); attention scores scaled by 1/sqrt(attention_scale_dim) (query_pre_attn_scalar)
    # instead of 1/sqrt(head_dim)
    embedding_scale: bool = False
    norm_weight_offset: bool = False
    activation: Literal["silu", "gelu_tanh"] = "silu"
    sandwich_norms: bool = False
    attention_scale_dim: float | None = bounded(None, gt=0, le=2**20)
    # Local layers: a query sees the last sliding_window positions of its document (itself included), with RoPE base
    # rope_local_theta (None: rope_theta) and no RoPE scaling; with sliding_window_pattern N every Nth layer (the
    # N-th, 2N-th, ...) is global (Gemma 3: 6), without it every layer is local (Mistral). None: all global.
    sliding_window: int | None = bounded(None, ge=1, le=2**24)
    sliding_window_pattern: int | None = bounded(None, ge=2, le=1024)
    rope_local_theta: float | None = bounded(None, gt=0)
    # auto: FlexAttention on CUDA when documents are masked, SDPA otherwise (CPU, plain causal, KV-cache decoding)
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    hf_architecture: str = "LlamaForCausalLM"  # the Hugging Face family exported to, one of HF_ARCHITECTURES

    def __post_init__(self) -> None:
        """Normalise (a rope_scaling mapping, the derived n_kv_heads and head_dim), then check every declared range
        and choice and the cross-field rules (``check_fields``) once, wherever a config is made: a stage config, a
        checkpoint's, --model. ``InvalidModelConfig`` otherwise: where it entered names the source."""
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim_override is not None and self.head_dim_override * self.n_heads == self.dim:
            self.head_dim_override = None  # the derived value: kept unset, so equal configs compare equal
        try:
            check_config(self, prefix="ModelConfig.")
        except ConfigError as error:
            raise InvalidModelConfig(str(error)) from None

    def check_fields(self, prefix: str) -> None:
        """The rules between fields (``check_config`` runs it after each field's own)."""
        if self.head_dim_override is not None and self.head_dim_override % 2:
            raise ConfigError(f"{prefix}head_dim_override must be even (RoPE), got {self.head_dim_override!r}")
        if self.head_dim_override is None and self.dim % self.n_heads:
            raise ConfigError(f"{prefix}dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{prefix}n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{prefix}dim / n_heads = {self.head_dim} must be even for RoPE")
        for key in ("sliding_window_pattern", "rope_local_theta"):
            if self.sliding_window is None and getattr(self, key) is not None:
                raise ConfigError(f"{prefix}{key} is for local layers: it needs a {prefix}sliding_window")
        problem = self.rope_scaling.problem() if self.rope_scaling is not None else None
        if problem:
            raise ConfigError(f"{prefix}rope_scaling {problem}")
        if self.hf_architecture not in HF_ARCHITECTURES:
            raise ConfigError(
                f"{prefix}hf_architecture must be one of {HF_ARCHITECTURES}, got {self.hf_architecture!r}"
            )
        for key, value in family_of(self.hf_architecture).block.items():
            if getattr(self, key) != value:  # e.g. a Qwen3 without QK norm: not the family's model
                raise ConfigError(
                    f"{prefix}{key} must be {value!r} for hf_architecture {self.hf_architecture} (every model of that "
                    f"family has it), got {getattr(self, key)!r}"
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

    def is_local(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.sliding_window_pattern is None or (layer + 1) % self.sliding_window_pattern != 0

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
        ffn = 3 * self.dim * self.hidden_dim
        norms = (4 if self.sandwich_norms else 2) * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + ffn + norms) + self.dim + embeddings

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x matmul weights + attention's 12·L·d·T (PaLM, app. B),
        d being the query width n_heads·head_dim (dim unless ``head_dim_override``).

        The embedding lookup is no matmul; the output projection is, tied or not.
        """
        matmul_params = self.num_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1)
        return 6 * matmul_params + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
# Hugging Face Llama's names for the same layers, accepted in peft.target_modules and written in exported adapters
HF_TARGETS = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
}


@dataclass
class PeftConfig:
    """The ``peft`` section of every fine-tuning stage. ``kind: none`` trains every weight."""

    kind: Literal["none", "lora"] = "none"
    rank: int = bounded(16, ge=1)
    alpha: float = bounded(32.0, gt=0)  # the adapter's output is scaled by alpha / rank
    dropout: float = bounded(0.0, ge=0, lt=1)  # on the adapter's input, in training
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    @property
    def enabled(self) -> bool:
        return self.kind == "lora"


def lantern_targets(config: PeftConfig) -> list[str]:
    """``target_modules`` in Lantern's layer names (Hugging Face's mapped), in order, without repeats."""
    return list(dict.fromkeys(HF_TARGETS.get(name, name) for name in config.target_modules))


def adapter_config(model: Any) -> PeftConfig | None:
    """The section a model's adapters were added with, or None for a model without adapters (also under wrappers:
    FSDP2 keeps the attribute, and compile wraps the blocks only)."""
    return getattr(model, "adapter_config", None)
