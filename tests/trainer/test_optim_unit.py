"""trainer/optim.py cases tests/trainer/test_optim.py leaves open: frozen and untied parameters in the
weight-decay split, the values each group carries, schedules without warmup or without decay, WSD's values and
lengths, and the AdamW settings. No training runs; each test builds at most a one-layer model."""

from __future__ import annotations

import math

import pytest
import torch

from models.model import ModelConfig, Transformer
from trainer.config import OptimConfig
from trainer.optim import build_optimizer, parameter_groups, warmup_cosine
from trainer.optim_config import decay_length, scheduled_lr, wsd


def tiny(**changes) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=50, multiple_of=16, **changes))


def ids(group: dict) -> set[int]:
    return {id(p) for p in group["params"]}


def test_groups_carry_the_configured_decay_and_zero():
    decay, no_decay = parameter_groups(tiny(), 0.25)
    assert decay["weight_decay"] == 0.25 and no_decay["weight_decay"] == 0.0


def test_an_untied_output_head_is_decayed_and_the_embeddings_are_not():
    model = tiny(tie_embeddings=False)
    decay, no_decay = parameter_groups(model, 0.1)
    assert id(model.output.weight) in ids(decay)  # a projection matrix like any other
    assert id(model.tok_embeddings.weight) in ids(no_decay)
    for name, parameter in model.named_parameters():
        if parameter.ndim < 2:  # norms' gains
            assert id(parameter) in ids(no_decay), name
    assert ids(decay).isdisjoint(ids(no_decay))
    assert len(ids(decay) | ids(no_decay)) == len(list(model.parameters()))


def test_frozen_parameters_are_left_out_of_both_groups():
    model = tiny()
    frozen = [model.layers[0].attention.wq.weight, model.norm.weight]
    for parameter in frozen:
        parameter.requires_grad_(False)
    decay, no_decay = parameter_groups(model, 0.1)
    for parameter in frozen:
        assert id(parameter) not in ids(decay) | ids(no_decay)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decay["params"]) + len(no_decay["params"]) == len(trainable)


def test_no_warmup_starts_at_the_peak():
    kwargs = dict(warmup_steps=0, max_steps=10, lr=2.0, min_lr=0.5)
    assert warmup_cosine(0, **kwargs) == pytest.approx(2.0)
    assert warmup_cosine(5, **kwargs) == pytest.approx(0.5 + 0.75 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(10, **kwargs) == pytest.approx(0.5)


def test_warmup_is_linear_from_lr_over_warmup_steps():
    kwargs = dict(warmup_steps=4, max_steps=100, lr=3e-4, min_lr=3e-5)
    assert [warmup_cosine(s, **kwargs) for s in range(4)] == pytest.approx([0.75e-4, 1.5e-4, 2.25e-4, 3e-4])
    assert warmup_cosine(0, **kwargs) > 0  # the first step already moves the weights


def test_min_lr_equal_to_lr_is_a_constant_schedule_after_warmup():
    kwargs = dict(warmup_steps=2, max_steps=20, lr=1e-3, min_lr=1e-3)
    assert [warmup_cosine(s, **kwargs) for s in range(2, 30)] == pytest.approx([1e-3] * 28)


def test_warmup_as_long_as_the_run_ends_at_min_lr():
    kwargs = dict(warmup_steps=10, max_steps=10, lr=1.0, min_lr=0.1)
    assert warmup_cosine(9, **kwargs) == pytest.approx(1.0)
    assert warmup_cosine(10, **kwargs) == pytest.approx(0.1)


def test_both_groups_follow_the_schedule_and_adamw_gets_the_settings():
    model = tiny()
    optimizer, schedule = build_optimizer(
        model, lr=1e-2, min_lr=1e-3, weight_decay=0.1, betas=[0.8, 0.9], eps=1e-6, warmup_steps=2, max_steps=6
    )
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["betas"] == (0.8, 0.9)  # a config list becomes AdamW's tuple
    assert optimizer.defaults["eps"] == 1e-6
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.defaults["fused"]  # one kernel a step on CPU too: 7x the foreach default there
    for step in range(8):
        expected = warmup_cosine(step, warmup_steps=2, max_steps=6, lr=1e-2, min_lr=1e-3)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected, expected]), step
        optimizer.step()
        schedule.step()


# ---- WSD: warmup, stable, cooldown (trainer/optim_config.py) ----

WSD = dict(warmup_steps=10, max_steps=110, lr=1.0, min_lr=0.1, decay_steps=20)


def test_wsd_linear_cooldown_values():
    values = {s: wsd(s, **WSD, shape="linear") for s in (0, 9, 10, 89, 90, 95, 100, 109, 110, 500)}
    assert values == pytest.approx(
        {0: 0.1, 9: 1.0, 10: 1.0, 89: 1.0, 90: 1.0, 95: 0.1 + 0.9 * 0.75, 100: 0.55, 109: 0.1 + 0.9 * 0.05,
         110: 0.1, 500: 0.1}
    )  # fmt: skip


def test_wsd_one_minus_sqrt_cooldown_values():
    assert wsd(90, **WSD) == pytest.approx(1.0)  # 1-sqrt is the default shape
    assert wsd(95, **WSD) == pytest.approx(0.1 + 0.9 * 0.5)  # progress 1/4: sqrt 1/2
    assert wsd(100, **WSD) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))
    assert wsd(110, **WSD) == pytest.approx(0.1)
    # 1-sqrt drops faster at first and stays above linear nowhere inside the cooldown
    assert all(wsd(s, **WSD) <= wsd(s, **WSD, shape="linear") for s in range(90, 111))
    values = [wsd(s, **WSD) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_length_from_steps_or_a_fraction():
    assert decay_length(OptimConfig(schedule="wsd", decay_steps=7), 100) == 7
    assert decay_length(OptimConfig(schedule="wsd", decay_fraction=0.1), 100) == 10
    assert decay_length(OptimConfig(schedule="wsd"), 100) == 20  # neither: 20% of the run
    assert decay_length(OptimConfig(schedule="wsd", decay_fraction=0.01), 20) == 1  # at least one step
    optim = OptimConfig(schedule="wsd", decay_fraction=0.25, decay_shape="linear", lr=2.0, min_lr=0.0, warmup_steps=0)
    assert [scheduled_lr(s, optim, 8) for s in range(9)] == pytest.approx([2, 2, 2, 2, 2, 2, 2, 1, 0])


def test_a_branched_cooldown_follows_the_schedule_of_a_run_that_long_from_the_start():
    """The schedule depends on (step, max_steps) only: up to the short run's cooldown the long run's rates are its."""
    long, short = OptimConfig(schedule="wsd", decay_steps=100), OptimConfig(schedule="wsd", decay_steps=5)
    assert [scheduled_lr(s, long, 1000) for s in range(116)] == [scheduled_lr(s, short, 120) for s in range(116)]
    assert scheduled_lr(116, short, 120) < scheduled_lr(116, long, 1000) == long.lr


def test_the_scheduler_follows_wsd_for_every_group():
    optimizer, schedule = build_optimizer(
        tiny(), lr=1e-2, min_lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=2, max_steps=10,
        schedule="wsd", decay_steps=4, decay_shape="linear",
    )  # fmt: skip
    for step in range(12):
        expected = wsd(step, warmup_steps=2, max_steps=10, lr=1e-2, min_lr=1e-3, decay_steps=4, shape="linear")
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected, expected]), step
        optimizer.step()
        schedule.step()
