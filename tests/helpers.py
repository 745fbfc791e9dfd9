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


# torch.distributed's rendezvous variables: a value left in this process by an in-process test must never
# reach a child, or its ranks would meet at a stale port (once: EADDRINUSE on one rank, the other waiting).
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this one's without rendezvous variables, the repository on
    PYTHONPATH, one OpenMP thread per process (two ranks on two cores; kernels take the same path each run),
    inductor compiling in-process (no pool of compile workers per rank), plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    env.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=str(ROOT))
    return {**env, **extra}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m alignment.commands.cli *args`` in a new process from the repository root (``subprocess_env``); it
    must succeed (the assertion shows the end of its stderr)."""
    env = subprocess_env()
    command = [sys.executable, "-m", "alignment.commands.cli", *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return result
