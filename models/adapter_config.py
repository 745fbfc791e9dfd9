"""The ``peft`` config section (LoRA adapters) and the names of the layers it may adapt; no torch, no peft, so that a
stage schema and ``lantern --help`` import it for nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from models.config_checks import bounded

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
