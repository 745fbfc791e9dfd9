"""models/config_checks.py: the RANGES table, its lookup, and check_ranges' boundaries, key paths and messages."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from alignment.schemas.pretrain import PretrainConfig
from alignment.schemas.rl import PPOConfig
from models import config_checks
from models.config_checks import (
    ANY_FINITE,
    AT_LEAST_0,
    AT_LEAST_1,
    POSITIVE,
    RANGES,
    UNIT,
    UNIT_HALF_OPEN,
    check_ranges,
    numeric_fields,
    range_rule,
)
from models.errors import ConfigError

# ---- the RANGES table and its lookup


def test_rules_are_well_formed():
    for key, rule in RANGES.items():
        low, high, low_open, high_open = rule
        assert isinstance(low_open, bool) and isinstance(high_open, bool), key
        # a rule that bounds nothing belongs in UNBOUNDED, unless it asks for a finite number
        assert low is not None or high is not None or rule == ANY_FINITE, key
        if low is not None and high is not None:
            assert low < high, key
        if high is None:
            assert not high_open, key  # "open at infinity" means nothing; _describe would not show it


def test_a_few_rules_say_what_the_fields_mean():
    assert RANGES["lr"] == POSITIVE  # lr = 0 never trains
    assert RANGES["min_lr"] == AT_LEAST_0  # decaying to 0 is common
    assert RANGES["betas"] == UNIT_HALF_OPEN  # an Adam beta of 1 never forgets
    assert RANGES["gamma"] == UNIT and RANGES["lam"] == UNIT
    assert RANGES["top_p"] == (0, 1, True, False)  # top_p = 1 keeps every token, 0 keeps none
    assert RANGES["max_steps"] == AT_LEAST_1 and RANGES["warmup_steps"] == AT_LEAST_0


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("optim.lr", POSITIVE),  # a stage's key
        ("sft.optim.lr", POSITIVE),  # the same key as a pipeline sets it
        ("critic_optim.min_lr", AT_LEAST_0),
        ("ppo.gamma", UNIT),
        ("lr", POSITIVE),  # a bare field name
        ("model.dim", None),  # ModelConfig checks its own fields
        ("sft.model.dim", None),
        ("model.rope_scaling.factor", None),
        ("optim.no_such_field", None),
    ],
)
def test_range_rule_by_key_path(path, expected):
    assert range_rule(path) == expected


def test_a_section_qualified_rule_wins_over_the_field_name(monkeypatch):
    monkeypatch.setitem(RANGES, "ppo.temperature", UNIT)  # a made-up rule, distinct from "temperature"
    assert range_rule("ppo.temperature") == UNIT
    assert range_rule("pipeline.ppo.temperature") == UNIT  # the last section decides, not the first
    assert range_rule("sample.temperature") == RANGES["temperature"] == AT_LEAST_0
    assert range_rule("eval.temperature") == AT_LEAST_0


def test_numeric_fields_lists_numbers_and_number_lists_by_key_path():
    found = numeric_fields(PretrainConfig)
    assert found["optim.lr"] is float
    assert "optim.betas" in found  # list[float]
    assert "trainer.peak_tflops" in found and "loader.val_batches" in found  # float | None, int | None
    assert "model.dim" in found  # nested sections are walked
    for not_numeric in ("trainer.compile", "optim.decay_embeddings_and_norms", "run.name", "trainer.precision"):
        assert not_numeric not in found  # bools, strings and Literals are not range-checked
    assert not {"optim", "trainer", "model", "loader"} & set(found)  # sections are walked, never listed


# ---- check_ranges: boundaries, key paths, messages


def pretrain(**changes) -> PretrainConfig:
    config = PretrainConfig()
    for path, value in changes.items():
        section, name = path.split("__")
        setattr(getattr(config, section), name, value)
    return config


ACCEPTED = [
    ("optim__lr", 1e-12),  # POSITIVE: any value above 0 (min_lr set to 0 below, or min_lr > lr would refuse it)
    ("optim__min_lr", 0.0),  # AT_LEAST_0: 0 itself
    ("optim__warmup_steps", 0),
    ("optim__weight_decay", 0.0),
    ("optim__grad_clip", None),  # None (off) is not checked
    ("optim__betas", [0.0, 0.999999]),  # [0, 1)
    ("trainer__max_steps", 1),  # AT_LEAST_1: 1 itself
    ("trainer__max_nonfinite_steps", 0),
    ("trainer__peak_tflops", None),
    ("loader__val_batches", None),
    ("run__seed", 0),
    ("sample__temperature", 0.0),  # greedy
    ("data__val_fraction", 0.0),  # [0, 1): nothing held out is allowed
]
REFUSED = [
    ("optim__lr", 0.0, "optim.lr must be > 0 but got 0.0"),  # POSITIVE: 0 is outside
    ("optim__lr", -1e-3, "optim.lr must be > 0"),
    ("optim__min_lr", -1e-12, "optim.min_lr must be >= 0"),
    ("optim__warmup_steps", -1, "optim.warmup_steps must be >= 0 but got -1"),
    ("optim__grad_clip", 0.0, "optim.grad_clip must be > 0"),
    ("optim__eps", 0.0, "optim.eps must be > 0"),
    ("optim__betas", [0.9, 1.0], "optim.betas[1] must be in [0, 1) but got 1.0"),  # the element is named
    ("optim__betas", [-0.1, 0.95], "optim.betas[0] must be in [0, 1)"),
    ("trainer__max_steps", 0, "trainer.max_steps must be >= 1 but got 0"),
    ("trainer__accumulate_grad_batches", 0, "trainer.accumulate_grad_batches must be >= 1"),
    ("trainer__peak_tflops", 0.0, "trainer.peak_tflops must be > 0"),
    ("loader__micro_batch_size", 0, "loader.micro_batch_size must be >= 1"),
    ("checkpoint__keep_last", 0, "checkpoint.keep_last must be >= 1"),
    ("data__val_fraction", 1.0, "data.val_fraction must be in [0, 1) but got 1.0"),  # open at 1
    ("sample__temperature", -0.5, "sample.temperature must be >= 0"),
]


@pytest.mark.parametrize(("key", "value"), ACCEPTED, ids=[k.replace("__", ".") for k, _ in ACCEPTED])
def test_values_on_an_inclusive_boundary_are_accepted(key, value):
    check_ranges(pretrain(**{"optim__min_lr": 0.0, key: value}), "<test>")


@pytest.mark.parametrize(
    ("key", "value", "message"), REFUSED, ids=[f"{k.replace('__', '.')}={v}" for k, v, _ in REFUSED]
)
def test_values_outside_name_the_full_key_path(key, value, message):
    with pytest.raises(ConfigError) as caught:
        check_ranges(pretrain(**{key: value}), "configs/x.yaml")
    assert str(caught.value).startswith(f"configs/x.yaml: {message}"), str(caught.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("key", ["optim__lr", "optim__weight_decay", "trainer__peak_tflops"])
def test_non_finite_floats_are_refused_even_without_an_upper_bound(key, value):
    with pytest.raises(ConfigError, match=key.replace("__", r"\.")):
        check_ranges(pretrain(**{key: value}), "<test>")


def test_closed_unit_interval_accepts_both_ends_and_nothing_beyond():
    for value in (0.0, 1.0):
        config = PPOConfig()
        config.ppo.gamma = value
        config.ppo.lam = value
        check_ranges(config, "<test>")
    for key, value in (("gamma", 1.0 + 1e-9), ("lam", -1e-9)):
        config = PPOConfig()
        setattr(config.ppo, key, value)
        with pytest.raises(ConfigError, match=rf"ppo\.{key} must be in \[0, 1\] but got"):
            check_ranges(config, "<test>")


def test_half_open_top_p_refuses_0_and_accepts_1():
    config = PPOConfig()
    config.ppo.top_p = 1.0
    check_ranges(config, "<test>")
    config.ppo.top_p = 0.0
    with pytest.raises(ConfigError, match=r"ppo\.top_p must be in \(0, 1\] but got 0\.0"):
        check_ranges(config, "<test>")


def test_prefix_is_part_of_the_key_path():
    """A pipeline checks each stage's config under the stage's name: the message names sft.optim.lr."""
    with pytest.raises(ConfigError, match=r"^pipeline\.yaml: sft\.optim\.lr must be > 0"):
        check_ranges(pretrain(optim__lr=0.0), "pipeline.yaml", prefix="sft.")


def test_min_lr_may_equal_lr_but_not_exceed_it():
    check_ranges(pretrain(optim__lr=1e-4, optim__min_lr=1e-4), "<test>")  # a constant schedule after warmup
    with pytest.raises(ConfigError, match=r"optim\.min_lr \(0\.001\) must be <= optim\.lr \(0\.0001\)"):
        check_ranges(pretrain(optim__lr=1e-4, optim__min_lr=1e-3), "<test>")
    config = PPOConfig()  # each optimiser section is checked on its own, under its own key
    config.critic_optim.min_lr = 1.0
    with pytest.raises(ConfigError, match=r"critic_optim\.min_lr .* critic_optim\.lr"):
        check_ranges(config, "<test>")


def test_bools_and_unknown_fields_are_not_range_checked():
    @dataclass
    class Section:
        max_steps: bool = False  # a bool is an int in Python: False would be "0 < 1" if it were checked
        no_rule: int = -5

    @dataclass
    class Stage:
        trainer: Section = field(default_factory=Section)

    check_ranges(Stage(), "<test>")


def test_the_first_bad_field_is_reported_once_in_one_line():
    config = pretrain(optim__lr=0.0, trainer__max_steps=0)
    with pytest.raises(ConfigError) as caught:
        check_ranges(config, "<test>")
    message = str(caught.value)
    assert "\n" not in message
    assert message.count("must be") == 1


def test_defaults_pass():
    for schema in (PretrainConfig, PPOConfig):
        check_ranges(schema(), "<defaults>")


def test_describe_spells_each_kind_of_rule():
    assert config_checks._describe(POSITIVE) == "> 0"
    assert config_checks._describe(AT_LEAST_1) == ">= 1"
    assert config_checks._describe(UNIT) == "in [0, 1]"
    assert config_checks._describe(UNIT_HALF_OPEN) == "in [0, 1)"
    assert config_checks._describe((0, 1, True, False)) == "in (0, 1]"
