"""Checkers named in a config (alignment/rewards.py): the import path is looked up, never evaluated, and a bad
one is a one-line error naming the key, before any compute."""

from __future__ import annotations

import pytest

from alignment.rewards import load_checker
from data.demo_scoring import score_example
from models.errors import ConfigError


def test_an_import_path_names_the_function():
    checker = load_checker("data.demo_scoring:score_example", "eval.checker")
    assert checker is score_example
    assert checker({"task": "line_count", "meta": {"answer": "2"}}, "2") in (0.0, 1.0)
    assert checker({"prompt": "not a demo row"}, "2") is None  # rows it cannot judge are left out


def test_empty_means_no_checker():
    assert load_checker("", "eval.checker") is None


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("data.demo_scoring.score_example", "is not an import path"),
        ("data.demo_scoring:", "is not an import path"),
        ("__import__('os').system('true'):x", "is not an import path"),  # never evaluated
        ("no_such_package.module:f", "cannot import 'no_such_package.module'"),
        ("data.demo_scoring:no_such_function", "has no function 'no_such_function'"),
        ("data.demo_scoring:CHECKS", "has no function 'CHECKS'"),  # a table, not a function
    ],
)
def test_a_bad_path_is_one_line_naming_the_key(path, message):
    with pytest.raises(ConfigError, match=r"^ppo\.eval\.checker: .*" + message.replace("(", r"\(")) as raised:
        load_checker(path, "ppo.eval.checker")
    assert "\n" not in str(raised.value)
