"""models/config_checks.py: ranges declared at the field (``bounded``), Literal choices, and check_config's boundaries,
key paths and messages."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Literal

import pytest

from alignment.schemas.dpo import DPOConfig
from alignment.schemas.pretrain import PretrainConfig
from alignment.schemas.rejection_sampling import RejectionSamplingConfig
from alignment.schemas.reward import RMConfig
from alignment.schemas.rl import GRPOConfig, PPOConfig
from alignment.schemas.sft import SFTConfig
from models.config_checks import Range, bounded, check_config, numeric_fields, range_of
from models.errors import ConfigError

POSITIVE, AT_LEAST_0, AT_LEAST_1 = Range(gt=0), Range(ge=0), Range(ge=1)
UNIT, UNIT_HALF_OPEN = Range(ge=0, le=1), Range(ge=0, lt=1)
STAGES = (PretrainConfig, SFTConfig, RMConfig, PPOConfig, GRPOConfig, DPOConfig, RejectionSamplingConfig)

# ---- ranges declared at the field


def declared_ranges(schema: type, seen: set | None = None) -> list[tuple[str, Range]]:
    """(owner.field, range) of every bounded field under ``schema``'s sections."""
    seen = set() if seen is None else seen
    found = []
    for item in fields(schema):
        kind = item.default_factory() if callable(item.default_factory) else item.default  # type: ignore[misc]
        if is_dataclass(kind) and type(kind) not in seen:
            seen.add(type(kind))
            found += declared_ranges(type(kind), seen)
        elif "range" in item.metadata:
            found.append((f"{schema.__name__}.{item.name}", item.metadata["range"]))
    return found


def test_rules_are_well_formed():
    rules = [rule for schema in STAGES for rule in declared_ranges(schema)]
    assert len(rules) > 60
    for key, rule in rules:
        assert rule.ge is None or rule.gt is None, key  # one low end
        assert rule.le is None or rule.lt is None, key  # one high end
        low, high = (rule.gt, rule.ge)[rule.gt is None], (rule.lt, rule.le)[rule.lt is None]
        if low is not None and high is not None:
            assert low < high, key


def test_a_few_rules_say_what_the_fields_mean():
    assert range_of(PretrainConfig, "optim.lr") == POSITIVE  # lr = 0 never trains
    assert range_of(PretrainConfig, "optim.min_lr") == AT_LEAST_0  # decaying to 0 is common
    assert range_of(PretrainConfig, "optim.betas") == UNIT_HALF_OPEN  # an Adam beta of 1 never forgets
    assert range_of(PPOConfig, "ppo.gamma") == UNIT and range_of(PPOConfig, "ppo.lam") == UNIT
    assert range_of(PPOConfig, "ppo.top_p") == Range(gt=0, le=1)  # top_p = 1 keeps every token, 0 keeps none
    assert range_of(PretrainConfig, "trainer.max_steps") == AT_LEAST_1
    assert range_of(PretrainConfig, "optim.warmup_steps") == AT_LEAST_0


@pytest.mark.parametrize(
    ("schema", "path", "expected"),
    [
        (PretrainConfig, "optim.lr", POSITIVE),  # a stage's key
        (RejectionSamplingConfig, "sft.optim.lr", POSITIVE),  # the same field, one section deeper
        (PPOConfig, "critic_optim.min_lr", AT_LEAST_0),
        (PPOConfig, "ppo.gamma", UNIT),
        (PretrainConfig, "model.dim", Range(ge=1, le=2**20)),  # the model's sizes are bounded at their fields
        (PretrainConfig, "model.norm_eps", POSITIVE),  # declared at its field, checked once by check_config
        (PretrainConfig, "model.rope_scaling.factor", None),
        (PretrainConfig, "optim.no_such_field", None),
    ],
)
def test_range_of_a_key_path(schema, path, expected):
    assert range_of(schema, path) == expected


def test_each_section_declares_its_own_rule():
    assert range_of(PPOConfig, "ppo.temperature") == AT_LEAST_0  # 0: greedy rollouts
    assert range_of(PretrainConfig, "sample.temperature") == AT_LEAST_0
    assert range_of(RMConfig, "policy_samples.temperature") == AT_LEAST_0
    assert range_of(GRPOConfig, "grpo.group_size") == Range(gt=1)  # a group of one has no baseline
    assert range_of(GRPOConfig, "grpo.minibatch_size") == AT_LEAST_1  # redeclared in the subclass, still bounded


def test_numeric_fields_lists_numbers_and_number_lists_by_key_path():
    found = numeric_fields(PretrainConfig)
    assert found["optim.lr"] is float
    assert "optim.betas" in found  # list[float]
    assert "trainer.peak_tflops" in found and "loader.val_batches" in found  # float | None, int | None
    assert "model.dim" in found  # nested sections are walked
    for not_numeric in ("trainer.compile", "optim.decay_embeddings_and_norms", "run.name", "trainer.precision"):
        assert not_numeric not in found  # bools, strings and Literals are not range-checked
    assert not {"optim", "trainer", "model", "loader"} & set(found)  # sections are walked, never listed


# ---- check_config: boundaries, key paths, messages


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
    check_config(pretrain(**{"optim__min_lr": 0.0, key: value}), "<test>")


@pytest.mark.parametrize(
    ("key", "value", "message"), REFUSED, ids=[f"{k.replace('__', '.')}={v}" for k, v, _ in REFUSED]
)
def test_values_outside_name_the_full_key_path(key, value, message):
    with pytest.raises(ConfigError) as caught:
        check_config(pretrain(**{key: value}), "configs/x.yaml")
    assert str(caught.value).startswith(f"configs/x.yaml: {message}"), str(caught.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("key", ["optim__lr", "optim__weight_decay", "trainer__peak_tflops"])
def test_non_finite_floats_are_refused_even_without_an_upper_bound(key, value):
    with pytest.raises(ConfigError, match=key.replace("__", r"\.")):
        check_config(pretrain(**{key: value}), "<test>")


def test_closed_unit_interval_accepts_both_ends_and_nothing_beyond():
    for value in (0.0, 1.0):
        config = PPOConfig()
        config.ppo.gamma = value
        config.ppo.lam = value
        check_config(config, "<test>")
    for key, value in (("gamma", 1.0 + 1e-9), ("lam", -1e-9)):
        config = PPOConfig()
        setattr(config.ppo, key, value)
        with pytest.raises(ConfigError, match=rf"ppo\.{key} must be in \[0, 1\] but got"):
            check_config(config, "<test>")


def test_half_open_top_p_refuses_0_and_accepts_1():
    config = PPOConfig()
    config.ppo.top_p = 1.0
    check_config(config, "<test>")
    config.ppo.top_p = 0.0
    with pytest.raises(ConfigError, match=r"ppo\.top_p must be in \(0, 1\] but got 0\.0"):
        check_config(config, "<test>")


def test_prefix_is_part_of_the_key_path():
    """A pipeline checks each stage's config under the stage's name: the message names sft.optim.lr."""
    with pytest.raises(ConfigError, match=r"^pipeline\.yaml: sft\.optim\.lr must be > 0"):
        check_config(pretrain(optim__lr=0.0), "pipeline.yaml", prefix="sft.")


def test_min_lr_may_equal_lr_but_not_exceed_it():
    check_config(pretrain(optim__lr=1e-4, optim__min_lr=1e-4), "<test>")  # a constant schedule after warmup
    with pytest.raises(ConfigError, match=r"optim\.min_lr \(0\.001\) must be <= optim\.lr \(0\.0001\)"):
        check_config(pretrain(optim__lr=1e-4, optim__min_lr=1e-3), "<test>")
    config = PPOConfig()  # each optimiser section is checked on its own, under its own key
    config.critic_optim.min_lr = 1.0
    with pytest.raises(ConfigError, match=r"critic_optim\.min_lr .* critic_optim\.lr"):
        check_config(config, "<test>")


def test_bools_and_undeclared_fields_are_not_range_checked():
    @dataclass
    class Section:
        max_steps: bool = bounded(False, ge=1)  # a bool is an int in Python: False would be "0 < 1" if it were checked
        no_rule: int = -5

    @dataclass
    class Stage:
        trainer: Section = field(default_factory=Section)

    check_config(Stage(), "<test>")


def test_literal_choices_are_checked_and_named():
    @dataclass
    class Section:
        kind: Literal["a", "b"] = "a"
        compile: bool | Literal["auto"] = "auto"
        mode: Literal["x"] | None = None

    check_config(Section(compile=True), "<test>")
    with pytest.raises(ConfigError, match=r"^<test>: s\.kind must be one of a, b, got 'c'$"):
        check_config(Section(kind="c"), "<test>", prefix="s.")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^compile must be auto, true or false, got 'fast'$"):
        check_config(Section(compile="fast"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"mode must be one of x, got 1"):
        check_config(Section(mode=1))  # type: ignore[arg-type]


def test_a_section_rule_gets_the_file_and_prefix():
    @dataclass
    class Section:
        low: int = 0
        high: int = 1

        def check_fields(self, prefix: str) -> None:
            if self.low > self.high:
                raise ConfigError(f"{prefix}low must be <= {prefix}high")

    with pytest.raises(ConfigError, match=r"^f\.yaml: a\.low must be <= a\.high$"):
        check_config(Section(low=2), "f.yaml", prefix="a.")


def test_the_first_bad_field_is_reported_once_in_one_line():
    config = pretrain(optim__lr=0.0, trainer__max_steps=0)
    with pytest.raises(ConfigError) as caught:
        check_config(config, "<test>")
    message = str(caught.value)
    assert "\n" not in message
    assert message.count("must be") == 1


def test_defaults_pass():
    for schema in STAGES:
        check_config(schema(), "<defaults>")


def test_describe_spells_each_kind_of_rule():
    assert str(POSITIVE) == "> 0"
    assert str(AT_LEAST_1) == ">= 1"
    assert str(UNIT) == "in [0, 1]"
    assert str(UNIT_HALF_OPEN) == "in [0, 1)"
    assert str(Range(gt=0, le=1)) == "in (0, 1]"
    assert str(Range()) == "finite"
