"""The model families Lantern imports and exports, one ``Family`` record each: the Hugging Face architecture and
``model_type``, llama.cpp's GGUF architecture, the block options the family turns on, and the family's own
``config.json`` keys. The Hugging Face config mapping, GGUF in and out, the model's config check and the presets read
these records; adding a family is a record here, a preset and its tests (docs/pretrained.md#families)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the model module reads this one: only its type here
    from models.model import ModelConfig

__all__ = ["FAMILIES", "HF_ARCHITECTURES", "REFUSED_ARCHITECTURES", "Family", "family_of"]


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


@dataclass(frozen=True)
class Family:
    """One family: what names it in each format, the block options it has, and how its config.json differs."""

    name: str  # the short name presets and docs use
    hf_architecture: str  # config.json "architectures"; ModelConfig.hf_architecture
    hf_model_type: str  # config.json "model_type"
    gguf_architecture: str  # GGUF "general.architecture", as llama.cpp's convert_hf_to_gguf.py writes the family
    default_context: int  # max_position_embeddings when config.json has none: the transformers config class's default
    qkv_bias: bool = False  # biases on q/k/v (none on o): always present in the family
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE
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
        qk_norm=True,
        windowed=_qwen_windowed,
        hf_keys=_qwen3_keys,
    ),
)
HF_ARCHITECTURES: tuple[str, ...] = tuple(family.hf_architecture for family in FAMILIES)
_BY_ARCHITECTURE = {family.hf_architecture: family for family in FAMILIES}

# Architectures people bring that Lantern refuses with a reason of their own (any other: "not supported").
REFUSED_ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "its mixture-of-experts layers are not implemented (dense Qwen3 is supported)",
    "Qwen2MoeForCausalLM": "its mixture-of-experts layers are not implemented (dense Qwen2 is supported)",
    "MixtralForCausalLM": "its mixture-of-experts layers are not implemented (Mistral's dense models are supported)",
}


def family_of(hf_architecture: str) -> Family:
    """The record of a supported Hugging Face architecture (``ModelConfig.hf_architecture``)."""
    return _BY_ARCHITECTURE[hf_architecture]
