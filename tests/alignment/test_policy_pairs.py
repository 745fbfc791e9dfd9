"""The reward model on the policy's own samples (alignment/shared/policy_pairs.py): pairs made by hand from scored samples,
agreement with the checker by hand, and a tiny reward-model run that samples its policy, trains on the pairs and
measures its agreement on held-out prompts."""

from __future__ import annotations

import json
import math
from pathlib import Path

from alignment.schemas.reward import RMConfig
from alignment.shared.policy_pairs import agreement, preference_records
from alignment.stages.reward import run_rm
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def prompt(task: str = "line_count") -> dict:
    return {"record": {"messages": [{"role": "user", "content": f"q {task}"}], "task": task}, "prompt_ids": [1]}


def sample(answer: str, score: float) -> dict:
    return {"answer": answer, "score": score}


def test_one_pair_per_prompt_best_over_worst_and_none_without_a_preference():
    prompts = [prompt(), prompt("repeat"), prompt("first_speaker")]
    samples = [
        sample("2", 1.0), sample("3", 0.0), sample("4", 0.0),  # best "2" over a worst
        sample("a", 0.5), sample("b", 0.5), sample("c", 0.5),  # all equal: nothing to learn
        sample("x", 0.0), sample(" ", 1.0), sample("y", 1.0),  # the empty answer is never a side
    ]  # fmt: skip
    records = preference_records(prompts, samples, k=3)
    assert [(r["chosen"], r["rejected"], r["task"]) for r in records] == [
        ("2", "3", "line_count"),
        ("y", "x", "first_speaker"),
    ]
    assert records[0]["prompt"] == [{"role": "user", "content": "q line_count"}]


def test_agreement_by_hand():
    checker = [1.0, 0.0, 0.0, 0.5, 0.5, 1.0]  # two prompts of 3: pairs (0,1) (0,2) | (3,5) (4,5); (1,2) and (3,4) tie
    reward = [2.0, 1.0, 3.0, 0.0, 1.0, 1.0]  # agrees on (0,1), not (0,2); agrees on (3,5); ties on (4,5): half
    share, pairs = agreement(reward, checker, k=3)
    assert pairs == 4 and share == (1 + 0 + 1 + 0.5) / 4
    share, pairs = agreement([0.0, 0.0], [0.3, 0.3], k=2)
    assert pairs == 0 and math.isnan(share)


def test_reward_model_trains_on_policy_samples_and_reports_its_agreement(setup, tmp_path):
    """The tiny policy (tests/alignment/conftest.py) sampled on demo prompts, its answers labelled by the demo's
    checker: the pairs replace the synthetic ones, and the agreement is measured on held-out prompts."""
    checker = "tests.alignment.test_grpo:vowel_rich"  # pass or fail: most groups of 4 disagree somewhere
    config = load_config(
        RMConfig,
        ROOT / "configs/rm/tiny.yaml",
        [
            f"init.checkpoint={setup['policy']}", f"data.train=[{setup['prompts']}]", f"run.out_dir={tmp_path}",
            "logger.kind=none", "trainer.max_steps=4", "trainer.val_every_n_steps=4", "checkpoint.every_n_steps=100",
            "loader.micro_batch_size=2", "loss.normalization_pairs=4",
            f"policy_samples.policy={setup['policy']}", f"policy_samples.checker={checker}",
            f"policy_samples.prompts=[{setup['train_prompts']}]", f"policy_samples.heldout=[{setup['prompts']}]",
            "policy_samples.train=replace", "policy_samples.samples_per_prompt=4", "policy_samples.max_prompts=12",
            "policy_samples.response_max_tokens=12", "data.val_fraction=0.25",
        ],
    )  # fmt: skip
    run_dir = run_rm(config)
    pairs = [json.loads(line) for line in (run_dir / "policy_pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen_score"] > p["rejected_score"] for p in pairs)
    assert f"{run_dir / 'policy_pairs.jsonl'}" in (run_dir / "config.yaml").read_text()  # trained on them alone
    result = json.loads((run_dir / "policy_agreement.json").read_text())
    assert result["pairs"] > 0 and 0.0 <= result["agreement"] <= 1.0 and result["samples_per_prompt"] == 4
    assert (run_dir / "final" / "scalar_head.safetensors").is_file()
