"""Helpers the test modules share (the shared fixtures are in tests/conftest.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "the",
    "king",
    "is",
    "dead",
    "long",
    "live",
    "queen",
    "of",
    "england",
    "and",
    "thou",
    "art",
    "my",
    "lord",
    "good",
    "night",
    "sweet",
    "prince",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


class CaptureGradients(L.Callback):
    """Copies every gradient of `pl_module.model` just before the first optimizer step."""

    def __init__(self) -> None:
        self.gradients: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.gradients:
            self.gradients = {
                n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters() if p.grad is not None
            }


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m trainer.cli *args`` in a new process from the repository root (one OpenMP thread per
    process); it must succeed (the assertion shows the end of its stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "trainer.cli", *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return result
