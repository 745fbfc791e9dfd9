"""Unit tests of the checks made before any compute: trainer/checks.py (the RANGES table and the functions that
apply it, the tokenizer/model fit checks) and the trainer checks of trainer/build.py (check_trainer_config,
the callback order of fit_stage, the resume choice). No training runs here; every test takes well under a second.

tests/faults/test_config_errors.py checks, through load_config, that every numeric field of every schema has a
rule and that a value just below its low end is refused; these tests pin down the rules themselves: the exact
boundaries (inclusive or exclusive as declared), the key paths in the messages, and the lookup order."""

from __future__ import annotations

import base64
import logging
import math
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from alignment.schemas.pretrain import PretrainConfig
from alignment.schemas.rl import PPOConfig
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError
from models.model import ModelConfig
from trainer import checks
from trainer.build import (
    check_trainer_config,
    in_save_order,
    lightning_precision,
    make_strategy,
    resolve_resume,
)
from trainer.callbacks import AtomicCheckpoint, DataProgress, ExportFinal, LossPlot
from trainer.checks import (
    ANY_FINITE,
    AT_LEAST_0,
    AT_LEAST_1,
    POSITIVE,
    RANGES,
    UNIT,
    UNIT_HALF_OPEN,
    check_initial_model,
    check_ranges,
    check_same_tokenizer,
    check_tokenizer_fits_model,
    numeric_fields,
    range_rule,
)
from trainer.config import CheckpointConfig, OptimConfig, TrainerConfig

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
    assert checks._describe(POSITIVE) == "> 0"
    assert checks._describe(AT_LEAST_1) == ">= 1"
    assert checks._describe(UNIT) == "in [0, 1]"
    assert checks._describe(UNIT_HALF_OPEN) == "in [0, 1)"
    assert checks._describe((0, 1, True, False)) == "in (0, 1]"


# ---- tokenizer and initial model


def small_model(**changes) -> ModelConfig:
    return ModelConfig(**{"dim": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 512, "max_seq_len": 64, **changes})


def test_a_tokenizer_may_be_smaller_than_the_embeddings_but_never_larger():
    check_tokenizer_fits_model(SimpleNamespace(vocab_size=512), small_model(vocab_size=512))  # equal
    check_tokenizer_fits_model(SimpleNamespace(vocab_size=300), small_model(vocab_size=512))  # padded table
    with pytest.raises(ValueError) as caught:
        check_tokenizer_fits_model(
            SimpleNamespace(vocab_size=513, path="tok.model"), small_model(vocab_size=512), model_name="ckpt/"
        )
    message = str(caught.value)
    assert "tok.model has 513 tokens" in message and "ckpt/ has vocab_size 512" in message
    assert "model.vocab_size >= 513" in message  # says what to set


def byte_tokenizer(swap: bool = False) -> tuple[dict[bytes, int], bytes]:
    ranks = {bytes([i]): i for i in range(256)}
    if swap:  # same size, different ids: exactly what the check is for
        ranks[b"a"], ranks[b"b"] = ranks[b"b"], ranks[b"a"]
    raw = b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    return ranks, raw


def test_a_checkpoint_must_be_used_with_the_tokenizer_it_carries(tmp_path):
    ranks, raw = byte_tokenizer()
    tokenizer = Tokenizer(ranks, path="mine.model")
    check_same_tokenizer(tokenizer, tmp_path, key="data.tokenizer")  # the folder carries none: nothing to compare
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(raw)  # Meta's layout
    check_same_tokenizer(tokenizer, tmp_path, key="data.tokenizer")  # the same ranks: same fingerprint

    other_ranks, _ = byte_tokenizer(swap=True)
    other = Tokenizer(other_ranks, path="other.model")
    assert other.vocab_size == tokenizer.vocab_size and other.fingerprint != tokenizer.fingerprint
    with pytest.raises(ValueError) as caught:
        check_same_tokenizer(other, tmp_path, key="data.tokenizer")
    assert f"set data.tokenizer={tmp_path / 'original' / 'tokenizer.model'}" in str(caught.value)
    assert "other.model" in str(caught.value)

    (tmp_path / "tokenizer.model").write_bytes(byte_tokenizer(swap=True)[1])  # the top-level file is read first
    check_same_tokenizer(other, tmp_path, key="data.tokenizer")


def stage_config(model: ModelConfig, seq_len: int, checkpoint: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        init=SimpleNamespace(checkpoint=checkpoint), model=model, data=SimpleNamespace(seq_len=seq_len)
    )


def test_initial_model_sequences_must_fit_the_context():
    config = stage_config(small_model(), seq_len=64)
    check_initial_model(config, SimpleNamespace(vocab_size=512), small_model())
    config = stage_config(small_model(), seq_len=65)
    with pytest.raises(ConfigError, match=r"data\.seq_len \(65\) exceeds the model's max_seq_len \(64\)"):
        check_initial_model(config, SimpleNamespace(vocab_size=512), small_model())


def test_initial_model_from_a_checkpoint_replaces_the_configured_one(tmp_path, caplog):
    built = small_model(n_layers=2)
    config = stage_config(small_model(), seq_len=32, checkpoint=str(tmp_path))  # no tokenizer in the folder
    with caplog.at_level(logging.WARNING):
        check_initial_model(config, SimpleNamespace(vocab_size=512), built)
    assert config.model is built
    assert "model section ignored" in caplog.text
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} has vocab_size 512")):  # named as the model
        check_initial_model(config, SimpleNamespace(vocab_size=600, path="big.model"), built)


def test_a_model_section_nobody_set_is_replaced_without_a_warning(tmp_path, caplog):
    """The pipeline's stage presets name no model (they start from the previous stage's): the schema's default
    section then stands for nothing the user asked for, and a default run prints no warning about it."""
    built = small_model(n_layers=2)
    config = stage_config(ModelConfig(), seq_len=32, checkpoint=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        check_initial_model(config, SimpleNamespace(vocab_size=512), built)
    assert config.model is built
    assert "model section ignored" not in caplog.text


def test_initial_model_without_a_checkpoint_keeps_the_config_and_names_model_vocab_size(caplog):
    configured = small_model()
    config = stage_config(configured, seq_len=32)
    with caplog.at_level(logging.WARNING):
        check_initial_model(config, SimpleNamespace(vocab_size=512), small_model(n_layers=2))
    assert config.model is configured and "model section ignored" not in caplog.text
    with pytest.raises(ValueError, match=r"the model \(model\.vocab_size\) has vocab_size 512"):
        check_initial_model(config, SimpleNamespace(vocab_size=513, path="t"), configured)


# ---- trainer/build.py: what is checked before a Trainer exists


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"strategy": "single", "devices": 2}, r"trainer\.strategy 'single' .* trainer\.devices=2"),
        ({"strategy": "single", "num_nodes": 2}, r"trainer\.num_nodes=2"),
        ({"strategy": "ddp", "devices": 0}, r"trainer\.devices must be >= 1, got 0"),
        ({"max_steps": 0}, r"trainer\.max_steps must be >= 1"),
        ({"val_every_n_steps": 0}, r"trainer\.val_every_n_steps must be >= 1"),
        ({"cpu_offload": True, "strategy": "ddp"}, r"trainer\.cpu_offload needs trainer\.strategy 'fsdp'"),
        ({"cpu_offload": True, "strategy": "fsdp", "accelerator": "cpu"}, r"trainer\.cpu_offload .* needs GPUs"),
        ({"init_device": "meta", "strategy": "ddp"}, r"trainer\.init_device 'meta' needs trainer\.strategy 'fsdp'"),
    ],
)
def test_trainer_config_errors_name_the_keys(changes, message, restore_matmul_precision):
    with pytest.raises(ConfigError, match=message):
        check_trainer_config(TrainerConfig(**changes))


def test_trainer_config_check_resolves_precision_on_cpu(restore_matmul_precision):
    config = TrainerConfig(accelerator="cpu", strategy="fsdp", init_device="meta", devices=2)  # valid on CPU
    check_trainer_config(config)
    assert config.precision == "32-true"  # auto on CPU, recorded in the config
    assert torch.get_float32_matmul_precision() == "highest"


def test_lightning_gets_no_autocast_under_fsdp_bf16_mixed():
    """FSDP2's MixedPrecisionPolicy does bf16-mixed (trainer/parallel.py); Lightning must not autocast on top."""
    assert lightning_precision(TrainerConfig(strategy="fsdp", precision="bf16-mixed")) == "32-true"
    assert lightning_precision(TrainerConfig(strategy="ddp", precision="bf16-mixed")) == "bf16-mixed"
    assert lightning_precision(TrainerConfig(strategy="fsdp", precision="bf16-true")) == "bf16-true"


def test_strategies():
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    assert make_strategy(TrainerConfig(strategy="single")) == "auto"
    assert isinstance(make_strategy(TrainerConfig(strategy="ddp")), DDPStrategy)
    assert isinstance(make_strategy(TrainerConfig(strategy="fsdp", devices=2, num_nodes=3)), ModelParallelStrategy)


def test_checkpoints_are_saved_after_every_recorder_and_before_the_export(tmp_path):
    """fit_stage's order: whatever records a step runs before that step's checkpoint; the export runs last."""
    save = AtomicCheckpoint(tmp_path / "checkpoints", every_n_steps=1)
    export = ExportFinal(tmp_path / "final", None)
    progress, plot, extra = DataProgress(), LossPlot(tmp_path), L.Callback()
    ordered = in_save_order([save, export, progress, plot, extra])
    assert ordered == [progress, plot, extra, save, export]
    assert in_save_order([progress, extra]) == [progress, extra]  # nothing else moves


def test_atomic_checkpoint_refuses_a_zero_interval(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps"):
        AtomicCheckpoint(tmp_path, every_n_steps=0)
    with pytest.raises(ValueError, match="keep_last"):
        AtomicCheckpoint(tmp_path, every_n_steps=1, keep_last=0)


def test_resume_choice(tmp_path):
    assert resolve_resume(CheckpointConfig(resume="none"), tmp_path) is None
    assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path / "no-such-folder") is None
    assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path) is None  # empty: a fresh start
    with pytest.raises(ConfigError, match=r"checkpoint\.resume: .*missing\.ckpt does not exist"):
        resolve_resume(CheckpointConfig(resume=str(tmp_path / "missing.ckpt")), tmp_path)
    given = tmp_path / "step-00000004.ckpt"
    torch.save({"state_dict": {}}, given)
    assert resolve_resume(CheckpointConfig(resume=str(given)), tmp_path / "elsewhere") == str(given)


def test_a_section_checked_on_its_own_gets_its_prefix():
    check_ranges(OptimConfig(), "<test>", prefix="optim.")
    with pytest.raises(ConfigError, match=r"^<test>: critic_optim\.min_lr \(1\.0\) must be <= critic_optim\.lr"):
        check_ranges(OptimConfig(lr=0.5, min_lr=1.0), "<test>", prefix="critic_optim.")
