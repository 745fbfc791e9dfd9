"""The one way Lantern keys a cache or a re-run decision: a short SHA-256 of what the result depends on.

Three things are keyed this way: a pipeline stage (its resolved config and its inputs' keys), DPO's precomputed
reference log-probs (the reference's weights, the pairs, the numerics) and rejection sampling's samples (the
settings, the policy and reward models, the prompts). ``content_key`` hashes JSON-able parts; weights are hashed by
their bytes (``state_dict_digest``), and a folder from outside Lantern by its files' names, sizes and mtimes
(``folder_fingerprint``), which notices a replaced checkpoint without reading gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

KEY_CHARS = 16  # 64 bits: collisions are not a concern for the handful of runs a folder sees

PathLike = str | os.PathLike


def content_key(*parts: Any) -> str:
    """The key of ``parts``: strings as they are, anything else as sorted-key JSON (``str`` for what JSON cannot
    write), one per line."""
    text = "\n".join(part if isinstance(part, str) else json.dumps(part, sort_keys=True, default=str) for part in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]


def state_dict_digest(state: Mapping[str, Any]) -> str:
    """The SHA-256 of a model's weights: each tensor's name and bytes, in name order, read without a copy."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())  # its buffer: no copy
    return digest.hexdigest()


def folder_fingerprint(path: PathLike) -> str:
    """A hash of a folder's file names, sizes and mtimes (or one file's): enough to notice a replaced checkpoint
    without reading gigabytes. The pipeline keys re-runs on it, rejection sampling its samples."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root] if root.is_file() else []
    parts = [str(root.resolve())]
    parts += [
        f"{p.relative_to(root) if p != root else p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
