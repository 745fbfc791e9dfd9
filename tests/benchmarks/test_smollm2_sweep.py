"""benchmarks/smollm2_sweep.py's cheap parts: every setting's overrides load against the GRPO preset (a typo would
otherwise surface ten minutes into a run), the shaped reward builds from its config, and near_miss scores replies
as the checker reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignment.schemas.rl import GRPOConfig
from alignment.shared.rewards import build_reward
from benchmarks.smollm2_sweep import SETTINGS, grpo_overrides, near_miss
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MULTIPLY = {"task": "multiply", "meta": {"answer": "729", "a": 81, "b": 9}}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_setting_loads_against_the_grpo_preset(name):
    preset = load_config(GRPOConfig, str(ROOT / "configs/grpo/smollm2.yaml"), ["run.seed=1"])
    config = load_config(GRPOConfig, str(ROOT / "configs/grpo/smollm2.yaml"), grpo_overrides(name, 1))
    assert (config != preset) == (name != "preset")  # each setting changes the preset; "preset" changes nothing


def test_the_shaped_reward_is_the_checker_plus_half_the_closeness():
    config = load_config(GRPOConfig, str(ROOT / "configs/grpo/smollm2.yaml"), SETTINGS["near_miss"][1])
    reward = build_reward(config.reward.terms)
    assert [(term.name, term.weight) for term in reward.terms] == [
        ("data.demo.scoring:score_example", 1.0),
        ("benchmarks.smollm2_sweep:near_miss", 0.5),
    ]
    prompts = [{"record": MULTIPLY}] * 3
    answers = ["81 * 9 = 729", "81 * 9 = 779", "To calculate 81 * 9, multiply."]
    ids = torch.zeros(3, 4, dtype=torch.long)
    total, parts = reward.score(prompts, answers, ids, torch.ones_like(ids, dtype=torch.bool))
    assert parts["data.demo.scoring:score_example"].tolist() == [1.0, 0.0, 0.0]
    assert total.tolist() == pytest.approx([1.5, 0.5 * (1 - 50 / 729), 0.5 * (1 - 720 / 729)])


def test_near_miss_reads_the_last_number_as_the_checker_does():
    assert near_miss(MULTIPLY, "81 * 9 = 729") == 1.0
    assert near_miss(MULTIPLY, "81*9=1,458") == 0.0  # twice the answer: relative error 1
    assert near_miss(MULTIPLY, "81 * 9 = 700.") == pytest.approx(1 - 29 / 729)
    assert near_miss(MULTIPLY, "I cannot say.") == 0.0
    assert near_miss({"prompt": "not a demo row"}, "5") is None  # judged by no one, as the checker does
