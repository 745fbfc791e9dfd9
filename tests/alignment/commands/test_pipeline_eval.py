"""The pipeline's held-out comparison (alignment/commands/pipeline_eval.py) on hand-made per-prompt scores."""

from __future__ import annotations

from alignment.commands.pipeline_eval import compare_with


def test_sampled_scores_are_paired_with_sfts_like_greedy_ones():
    results = {
        "sft": {"scores": [0.0, 1.0], "sampled_scores": [0.25, 0.5]},
        "grpo": {"scores": [0.0, 1.0], "sampled_scores": [0.75, 1.0]},
        "pretrain": {"scores": [0.0, 0.0]},  # no samples: no sampled comparison
    }
    compare_with(results, "sft", "vs_sft")
    assert results["grpo"]["vs_sft"]["difference"] == 0.0
    assert results["grpo"]["vs_sft_sampled"] == {"difference": 0.5, "se": 0.0, "n": 2, "verdict": "gain"}
    assert "vs_sft_sampled" not in results["pretrain"] and "vs_sft" not in results["sft"]
