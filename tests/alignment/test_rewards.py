"""Checkers named in a config (alignment/shared/rewards.py): the import path is looked up, never evaluated, and a bad
one is a one-line error naming the key, before any compute."""

from __future__ import annotations

import pytest
import torch

from alignment.schemas.rl import RewardTermConfig
from alignment.shared.rewards import build_reward, load_checker
from data.demo.scoring import score_example
from models.errors import ConfigError
from models.heads import ScalarModel, save_scalar_model
from models.model import ModelConfig


def test_an_import_path_names_the_function():
    checker = load_checker("data.demo.scoring:score_example", "eval.checker")
    assert checker.__wrapped__ is score_example  # wrapped: an exception it raises names the checker and the row
    assert checker({"task": "line_count", "meta": {"answer": "2"}}, "2") in (0.0, 1.0)
    assert checker({"prompt": "not a demo row"}, "2") is None  # rows it cannot judge are left out


def test_empty_means_no_checker():
    assert load_checker("", "eval.checker") is None


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("data.demo.scoring.score_example", "is not an import path"),
        ("data.demo.scoring:", "is not an import path"),
        ("__import__('os').system('true'):x", "is not an import path"),  # never evaluated
        ("no_such_package.module:f", "cannot import 'no_such_package.module'"),
        ("data.demo.scoring:no_such_function", "has no function 'no_such_function'"),
        ("data.demo.scoring:CHECKS", "has no function 'CHECKS'"),  # a table, not a function
    ],
)
def test_a_bad_path_is_one_line_naming_the_key(path, message):
    with pytest.raises(ConfigError, match=r"^ppo\.eval\.checker: .*" + message.replace("(", r"\(")) as raised:
        load_checker(path, "ppo.eval.checker")
    assert "\n" not in str(raised.value)


# ---- the reward interface: terms, weights, normalisation ----


def test_reward_is_the_weighted_sum_of_checker_and_exact_match_terms():

    reward = build_reward(
        [
            RewardTermConfig("checker", "data.demo.scoring:score_example", 2.0),
            RewardTermConfig("exact_match", "", 0.5),
        ]
    )
    prompts = [
        {"record": {"task": "line_count", "meta": {"answer": "2"}}, "reference": "2"},
        {"record": {"task": "line_count", "meta": {"answer": "3"}}, "reference": "3"},
        {"record": {"prompt": "not a demo row"}, "reference": None},  # neither term can judge it
    ]
    ids, real = torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.bool)
    total, parts = reward.score(prompts, ["2", "4", "x"], ids, real)
    torch.testing.assert_close(total, torch.tensor([2.5, 0.0, 0.0]))
    assert set(parts) == {"data.demo.scoring:score_example", "exact_match"} and reward.unjudged == 2


def test_a_reward_model_term_is_normalised_by_its_exported_statistics(tmp_path):

    torch.manual_seed(0)
    config = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=300, multiple_of=16, max_seq_len=16)
    model = ScalarModel(config)
    folder = save_scalar_model(model, tmp_path / "rm", metadata={"reward_mean": 0.5, "reward_std": 2.0})
    reward = build_reward([RewardTermConfig("reward_model", str(folder), 1.0)])
    ids, real = torch.randint(0, 300, (2, 5)), torch.tensor([[True] * 5, [False, True, True, True, True]])
    total, _ = reward.score([{}, {}], ["", ""], ids, real)
    with torch.no_grad():
        raw = model(ids)[:, -1]  # the last real token of both rows is the last position
        raw[1] = model(ids[1:, 1:])[0, -1]  # row 1 is left-padded: its sequence starts at position 1
    torch.testing.assert_close(total, (raw - 0.5) / 2.0, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("term", "message"),
    [
        ({"kind": "checker", "path": ""}, r"reward.terms\[0\].path: a checker term needs"),
        ({"kind": "reward_model", "path": ""}, r"reward.terms\[0\].path: a reward_model term needs"),
        ({"kind": "reward_model", "path": "/no/such/folder"}, r"reward.terms\[0\]: .*/no/such/folder"),
        ({"kind": "exact_match", "weight": float("nan")}, r"reward.terms\[0\].weight must be a finite number"),
    ],
)
def test_bad_reward_terms_are_one_line_errors_naming_the_term(term, message):

    with pytest.raises(ConfigError, match=message):
        build_reward([RewardTermConfig(**term)])
