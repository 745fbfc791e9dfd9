"""The Llama 3-style decoder, its heads, generation and checkpoint interop.

The names below load on first use (PEP 562), so importing a light module of this package (``models.errors``,
``models.files.atomic``) does not import torch: ``lantern --help`` answers without it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVCache": "models.attention",
    "ModelConfig": "models.model",
    "RopeScaling": "models.model",
    "Transformer": "models.model",
    "load_checkpoint": "models.formats.checkpoint",
    "save_checkpoint": "models.formats.checkpoint",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
