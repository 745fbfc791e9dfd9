"""The model families Lantern imports and exports, one ``Family`` record each: the Hugging Face architecture and
``model_type``, llama.cpp's GGUF architecture, the block options the family turns on, and the family's own
``config.json`` keys. The Hugging Face config mapping, GGUF in and out, the model's config check and the presets read
these records; adding a family is a record here, a preset and its tests (docs/pretrained.md#families)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the model module reads this one: only its type here
    from models.model import ModelConfig

__all__ = ["BLOCK_OPTIONS", "FAMILIES", "HF_ARCHITECTURES", "REFUSED_ARCHITECTURES", "Family", "family_of"]


def _no_window(hf: dict[str, Any]) -> bool:
    return False


def _every_layer_windowed(hf: dict[str, Any]) -> bool:
    """Mistral: a sliding_window set applies to every layer."""
    return hf.get("sliding_window") is not None


def _qwen_windowed(hf: dict[str, Any]) -> bool:
    """Qwen2 / Qwen3: only with use_sliding_window, on the layers layer_types names (transformers 5) or, in 4.x
    configs, those from max_window_layers on."""
    if not hf.get("use_sliding_window"):
        return False
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return hf.get("max_window_layers", 28) < hf["num_hidden_layers"]


def _llama_keys(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


def _mistral_keys(config: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": None}


def _qwen_keys(config: ModelConfig) -> dict[str, Any]:
    """Full attention on every layer, stated the 4.x way (use_sliding_window, max_window_layers) and the 5 way."""
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.n_layers,
        "layer_types": ["full_attention"] * config.n_layers,
    }


def _qwen3_keys(config: ModelConfig) -> dict[str, Any]:
    return {**_qwen_keys(config), "attention_bias": False}


Read = tuple[dict[str, Any], dict[str, Any], list[str]]


def _read_silu(hf: dict[str, Any]) -> Read:
    """(config.json, no values of the family's own, problems): the Llama-shaped families' SwiGLU."""
    act = hf.get("hidden_act", "silu")
    return hf, {}, [] if act == "silu" else [f"hidden_act={act!r} (only silu / SwiGLU is supported)"]


def _gemma3_read(hf: dict[str, Any]) -> Read:
    """Gemma 3's config.json (transformers 4.x and 5): its global RoPE stated as Llama's is, and the values of its
    block: tanh-GELU, query_pre_attn_scalar, the window and which layers use it, the local layers' RoPE base."""
    problems = []
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        problems.append(f"hidden_activation={activation!r} (only gelu_pytorch_tanh is supported)")
    if hf.get("attn_logit_softcapping") is not None:
        problems.append(f"attn_logit_softcapping={hf['attn_logit_softcapping']} (attention softcapping)")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=true (an encoder's attention)")
    n_layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
    ]
    # the pattern config.json states, else Gemma 3's, else the first that gives these layer types
    candidates = [pattern, 6, *range(2, n_layers + 2)]
    periods = [p for p in candidates if isinstance(p, int) and p >= 2 and types == _layer_types(n_layers, p)]
    if not periods:
        problems.append(f"layer_types {types} (local layers with every Nth one global are supported)")
    rope = hf.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {
        "rope_type": "default",
        "rope_theta": hf.get("rope_local_base_freq", 10000.0),
    }
    if local.get("rope_type", "default") != "default":
        problems.append(f"sliding_attention rope type {local['rope_type']!r} (the local layers' RoPE is unscaled)")
    glob = rope.get("full_attention") or {k: v for k, v in rope.items() if not isinstance(v, dict)}
    llama_shaped = {**hf, "rope_parameters": glob or None}
    values = {
        "attention_scale_dim": float(hf.get("query_pre_attn_scalar", 256)),
        "logit_softcap": hf.get("final_logit_softcapping"),
        "sliding_window": hf.get("sliding_window", 4096),
        "sliding_window_pattern": periods[0] if periods else None,
        "rope_local_theta": float(local.get("rope_theta", 10000.0)),
    }
    return llama_shaped, values, problems


def _integral(value: float | None) -> float | int | None:
    """An integral float as an int (transformers' Gemma 3 config types query_pre_attn_scalar as one)."""
    return int(value) if value is not None and float(value).is_integer() else value


def _layer_types(n_layers: int, pattern: int) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]


def _gemma3_keys(config: ModelConfig) -> dict[str, Any]:
    """Gemma 3's own keys, stated the transformers 5 way (layer_types, rope_parameters per layer type) and the 4.x
    way (sliding_window_pattern, rope_local_base_freq, rope_theta)."""
    pattern = config.sliding_window_pattern or config.n_layers + 1
    local_theta = config.rope_local_theta or config.rope_theta
    glob = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        glob = {"rope_type": "linear", "factor": config.rope_scaling.factor, "rope_theta": config.rope_theta}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _integral(config.attention_scale_dim),
        "sliding_window": config.sliding_window,
        "layer_types": _layer_types(config.n_layers, pattern),
        "sliding_window_pattern": pattern,
        "rope_local_base_freq": local_theta,
        "rope_parameters": {
            "full_attention": glob,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "final_logit_softcapping": config.logit_softcap,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "use_bidirectional_attention": False,
    }


def _gemma3_gguf(config: ModelConfig) -> list[str]:
    """What llama.cpp's "gemma3" fixes rather than reads (and transformers' GGUF reader assumes): a model that differs
    would be another model there."""
    problems = []
    if config.sliding_window is not None and config.sliding_window_pattern != 6:
        problems.append(f"sliding_window_pattern={config.sliding_window_pattern} (llama.cpp: every 6th layer global)")
    if config.rope_local_theta not in (None, 10000.0):
        problems.append(f"rope_local_theta={config.rope_local_theta} (llama.cpp: 10000)")
    if config.attention_scale_dim != config.head_dim:
        problems.append(f"attention_scale_dim={config.attention_scale_dim} (llama.cpp: head_dim {config.head_dim})")
    return problems


# Gemma's block: the options every Gemma 3 model has (ModelConfig keys and values)
_GEMMA3_BLOCK = {
    "qk_norm": True,
    "embedding_scale": True,
    "norm_weight_offset": True,
    "sandwich_norms": True,
    "activation": "gelu_tanh",
}
# Gemma's names for its norms: post_attention_layernorm is the attention output's norm (Llama's pre-MLP norm)
_GEMMA3_NAMES = {
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "layers.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.post_ffn_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


@dataclass(frozen=True)
class Family:
    """One family: what names it in each format, the block options it has, and how its config.json differs."""

    name: str  # the short name presets and docs use
    hf_architecture: str  # config.json "architectures"; ModelConfig.hf_architecture
    hf_model_type: str  # config.json "model_type"
    gguf_architecture: str  # GGUF "general.architecture", as llama.cpp's convert_hf_to_gguf.py writes the family
    default_context: int  # max_position_embeddings when config.json has none: the transformers config class's default
    qkv_bias: bool = False  # biases on q/k/v (none on o): always present in the family (zeros on export when absent)
    block: Mapping[str, Any] = field(default_factory=dict)  # ModelConfig options every model of the family has
    hf_names: Mapping[str, str] = field(default_factory=dict)  # native -> Hugging Face names beyond HF_NAME_MAP's
    read: Callable[[dict[str, Any]], Read] = _read_silu  # config.json's family-specific values and problems
    softcap: bool = False  # config.json states a final logit softcap (Gemma's final_logit_softcapping)
    sliding_layers: bool = False  # sliding-window layers (Gemma 3's local ones) are the family's, imported and exported
    gguf_norm_shift: float = (
        0.0  # added to every norm weight in a GGUF file (llama.cpp's Gemma norms scale by w, not 1 + w)
    )
    gguf_problems: Callable[[ModelConfig], list[str]] = lambda config: []  # what GGUF cannot state of a model
    # config.json states head_dim even when it is dim // n_heads (Qwen2 reads it only when it differs)
    states_head_dim: bool = True
    # whether config.json turns a sliding window on for some layer shorter than the context (not implemented)
    windowed: Callable[[dict[str, Any]], bool] = _no_window
    hf_keys: Callable[[ModelConfig], dict[str, Any]] = _llama_keys  # the family's own config.json keys on export

    @property
    def gguf_interleaved_qk(self) -> bool:
        """llama.cpp's "llama" rotates interleaved pairs, so its converter permutes wq/wk rows (Meta's order); its
        other architectures rotate half-splits, Hugging Face's order."""
        return self.gguf_architecture == "llama"


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "llama", "llama", default_context=2048),
    Family(
        "mistral",
        "MistralForCausalLM",
        "mistral",
        "llama",  # llama.cpp converts Mistral's dense models as "llama"
        default_context=4096 * 32,
        windowed=_every_layer_windowed,
        hf_keys=_mistral_keys,
    ),
    Family(
        "qwen2",
        "Qwen2ForCausalLM",
        "qwen2",
        "qwen2",
        default_context=32768,
        qkv_bias=True,
        states_head_dim=False,
        windowed=_qwen_windowed,
        hf_keys=_qwen_keys,
    ),
    Family(
        "qwen3",
        "Qwen3ForCausalLM",
        "qwen3",
        "qwen3",
        default_context=32768,
        block={"qk_norm": True},
        windowed=_qwen_windowed,
        hf_keys=_qwen3_keys,
    ),
    Family(
        "gemma3",
        "Gemma3ForCausalLM",
        "gemma3_text",
        "gemma3",
        default_context=131072,
        block=_GEMMA3_BLOCK,
        hf_names=_GEMMA3_NAMES,
        read=_gemma3_read,
        softcap=True,
        sliding_layers=True,
        gguf_norm_shift=1.0,
        gguf_problems=_gemma3_gguf,
        hf_keys=_gemma3_keys,
    ),
)
# every ModelConfig option some family turns on, with its value when off (another family's model has it off)
BLOCK_OPTIONS: dict[str, Any] = {
    "qk_norm": False,
    "embedding_scale": False,
    "norm_weight_offset": False,
    "sandwich_norms": False,
    "activation": "silu",
}
HF_ARCHITECTURES: tuple[str, ...] = tuple(family.hf_architecture for family in FAMILIES)
_BY_ARCHITECTURE = {family.hf_architecture: family for family in FAMILIES}

# Architectures people bring that Lantern refuses with a reason of their own (any other: "not supported").
REFUSED_ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "its mixture-of-experts layers are not implemented (dense Qwen3 is supported)",
    "Qwen2MoeForCausalLM": "its mixture-of-experts layers are not implemented (dense Qwen2 is supported)",
    "MixtralForCausalLM": "its mixture-of-experts layers are not implemented (Mistral's dense models are supported)",
    "Gemma3ForConditionalGeneration": "its vision tower is not implemented (Gemma 3's text models, Gemma3ForCausalLM, "
    "are: 270M and 1B, or the language model of a larger one converted to that)",
}


def family_of(hf_architecture: str) -> Family:
    """The record of a supported Hugging Face architecture (``ModelConfig.hf_architecture``)."""
    return _BY_ARCHITECTURE[hf_architecture]
