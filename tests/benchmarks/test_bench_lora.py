"""benchmarks/bench_lora.py's cheap parts: the parameter counts against the closed form, and one DPO and one GRPO
step per variant on a one-layer model, where the reference with the adapters off must score what a copy of the
base scores."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.lora import memory, params
from models.model import ModelConfig

TINY = ModelConfig.from_preset("tiny")


def test_params_match_the_closed_form():
    rank = 16
    row = params.count_preset("tiny", rank, 32.0)
    kv = TINY.n_kv_heads * TINY.head_dim
    shapes = [(TINY.dim, TINY.dim), (TINY.dim, kv), (TINY.dim, kv), (TINY.dim, TINY.dim)]
    shapes += [(TINY.dim, TINY.hidden_dim), (TINY.hidden_dim, TINY.dim), (TINY.dim, TINY.hidden_dim)]
    assert row["lora_params"] == TINY.n_layers * sum(rank * (i + o) for i, o in shapes)
    assert row["base_params"] == TINY.num_params()
    full, lora = row["full_bytes"], row["lora_bytes"]
    assert full["total"] == 16 * row["base_params"]
    assert lora["total"] == 4 * row["base_params"] + 16 * row["lora_params"]
    assert row["grad_adam_pct_of_full"] == pytest.approx(100 * row["lora_params"] / row["base_params"])


def test_tied_embeddings_count_once():
    row = params.count_preset({**TINY.to_dict(), "tie_embeddings": True}, 16, 32.0)
    assert row["base_params"] == TINY.num_params() - TINY.vocab_size * TINY.dim


@pytest.mark.parametrize("step", ["dpo", "grpo"])
def test_the_adapters_off_reference_scores_what_a_copy_of_the_base_scores(step):
    config = ModelConfig(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=256, multiple_of=32, max_seq_len=64)
    args = argparse.Namespace(
        step=step, preset=None, rank=4, pairs=2, seq_len=24, prompt_len=6, prompts=2, group=2, new_tokens=5,
        chunk_size=8, repeat=1,
    )  # fmt: skip
    run = memory.dpo_step if step == "dpo" else memory.grpo_step
    losses = {}
    for variant in memory.VARIANTS:
        args.variant = variant
        policy, reference = memory.build_models(args, config)
        assert (reference is None) == (variant == "lora-shared")
        losses[variant] = run(args, policy, reference, memory.optimizer_for(policy))["loss"]
    assert losses["lora-shared"] == pytest.approx(losses["lora-copy"], abs=1e-6)
