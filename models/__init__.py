"""The Llama 3-style decoder, its heads, generation and checkpoint interop."""

from models.checkpoint import load_checkpoint, save_checkpoint
from models.model import KVCache, ModelConfig, RopeScaling, Transformer

__all__ = ["KVCache", "ModelConfig", "RopeScaling", "Transformer", "load_checkpoint", "save_checkpoint"]
