"""The ``optim`` section every training stage has (``OptimConfig``, with Muon's settings in ``MuonConfig``), the
rules across it and the stage's other sections, checked at load, and the learning-rate schedules it names.

The schedules are pure functions of (step, run length): linear warmup into cosine, constant, or WSD (warmup, a stable
phase, a cooldown to ``min_lr``). Being pure functions, a WSD cooldown branched from a stable-phase checkpoint follows
exactly the schedule of a run that had that length from the start."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

from models.config_checks import bounded
from models.errors import ConfigError


@dataclass
class MuonConfig:
    """``optim.name: muon``'s settings for the transformer blocks' matrices (torch.optim.Muon); AdamW keeps the rest."""

    lr: float | None = bounded(None, gt=0)  # None: optim.lr
    weight_decay: float | None = bounded(None, ge=0)  # None: optim.weight_decay
    momentum: float = bounded(0.95, ge=0, lt=1)
    nesterov: bool = True
    ns_steps: int = bounded(5, ge=1, le=99)  # Newton-Schulz iterations (torch refuses 100 or more)
    # match_rms_adamw (Moonlight, Liu et al. 2025): each matrix's update is scaled to AdamW's RMS (0.2 sqrt(max dim)),
    # so AdamW's tuned lr and weight decay carry over and optim.name=muon is a one-key switch; original (Keller
    # Jordan's sqrt(max(1, rows/cols))) wants a rate near 0.02 (muon.lr) and usually muon.weight_decay 0
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"


@dataclass
class OptimConfig:
    # adamw: every parameter; muon: Muon for the transformer blocks' 2-D matrices, AdamW (these keys) for the
    # embeddings, the output head, norms and biases
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = bounded(3e-4, gt=0)
    min_lr: float = bounded(3e-5, ge=0)
    warmup_steps: int = bounded(100, ge=0)
    weight_decay: float = bounded(0.1, ge=0)
    decay_embeddings_and_norms: bool = False
    betas: list[float] = bounded(factory=lambda: [0.9, 0.95], ge=0, lt=1)  # noqa: RUF009 (a dataclasses.field)
    eps: float = bounded(1e-8, gt=0)
    grad_clip: float | None = bounded(1.0, gt=0)
    z_loss: float = bounded(0.0, ge=0)
    # cosine: warmup, then cosine down to min_lr at trainer.max_steps; constant: warmup, then lr throughout; wsd:
    # warmup, lr (stable), then a cooldown to min_lr over the run's last decay_steps (or decay_fraction)
    schedule: Literal["cosine", "constant", "wsd"] = "cosine"
    decay_steps: int | None = bounded(None, ge=1)  # wsd's cooldown in steps; None: decay_fraction of the run
    decay_fraction: float | None = bounded(None, gt=0, le=1)  # None (and no decay_steps): 0.2
    decay_shape: Literal["linear", "1-sqrt"] = "1-sqrt"  # 1-sqrt beats linear at equal length (Hägele et al. 2024)
    muon: MuonConfig = field(default_factory=MuonConfig)

    def check_fields(self, prefix: str) -> None:
        if self.min_lr > self.lr:  # the schedule would climb
            raise ConfigError(f"{prefix}min_lr ({self.min_lr}) must be <= {prefix}lr ({self.lr})")
        if self.decay_steps is not None and self.decay_fraction is not None:
            raise ConfigError(
                f"{prefix}decay_steps ({self.decay_steps}) and {prefix}decay_fraction ({self.decay_fraction}) both "
                "set the WSD cooldown's length: give one"
            )
        given = "decay_steps" if self.decay_steps is not None else "decay_fraction"
        if self.schedule != "wsd" and getattr(self, given) is not None:
            raise ConfigError(
                f"{prefix}{given} sets the cooldown of {prefix}schedule 'wsd', but the schedule is {self.schedule!r}"
            )


def check_optim_sections(stage: Any, prefix: str) -> None:
    """A stage's optim sections against its trainer and peft sections: a WSD warmup and cooldown must fit in the run;
    Muon runs neither under FSDP (its matrices sharded) nor on LoRA's factors. One line naming the keys."""
    trainer = stage.trainer
    steps = stage.schedule_steps()
    steps_key = f"{prefix}trainer.max_steps" if steps == trainer.max_steps else f"the run's {steps} optimizer updates"
    peft = getattr(stage, "peft", None)
    for key, section in stage.optim_sections().items():
        check_schedule_fits(section, steps, f"{prefix}{key}.", steps_key)
        if section.name != "muon":
            continue
        if trainer.strategy == "fsdp":
            raise ConfigError(
                f"{prefix}{key}.name 'muon' cannot run under {prefix}trainer.strategy 'fsdp': torch.optim.Muon "
                "orthogonalises each whole weight matrix and FSDP2 gives every rank a shard of it; use "
                f"{prefix}trainer.strategy=ddp (or single), or {prefix}{key}.name=adamw"
            )
        if getattr(peft, "enabled", False):
            raise ConfigError(
                f"{prefix}{key}.name 'muon' with {prefix}peft.kind 'lora': Muon orthogonalises whole weight "
                f"matrices and LoRA trains only low-rank factors (AdamW's case); use {prefix}{key}.name=adamw"
            )


DEFAULT_DECAY_FRACTION = 0.2  # WSD's cooldown when neither length is given (Hägele et al. 2024: 20% matches cosine)


def warmup_cosine(
    step: int, *, warmup_steps: int, max_steps: int, lr: float, min_lr: float, schedule: str = "cosine"
) -> float:
    """Learning rate at ``step``: linear from lr/warmup to lr, then cosine down to min_lr at max_steps
    (``schedule="constant"``: lr after the warmup)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def wsd(
    step: int, *, warmup_steps: int, max_steps: int, lr: float, min_lr: float, decay_steps: int, shape: str = "1-sqrt"
) -> float:
    """Warmup-stable-decay: the same linear warmup, lr until ``max_steps - decay_steps``, then down to min_lr at
    max_steps, linearly or as 1 - sqrt(progress) (which holds the rate high for longer)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    start = max_steps - decay_steps
    if step < start:
        return lr
    progress = min(1.0, (step - start) / max(1, decay_steps))
    remaining = 1 - math.sqrt(progress) if shape == "1-sqrt" else 1 - progress
    return min_lr + (lr - min_lr) * remaining


def decay_length(optim: Any, max_steps: int) -> int:
    """WSD's cooldown in steps of a run of ``max_steps``: ``optim.decay_steps``, else ``optim.decay_fraction`` of the
    run (default 20%), at least one step."""
    if optim.decay_steps is not None:
        return int(optim.decay_steps)
    fraction = DEFAULT_DECAY_FRACTION if optim.decay_fraction is None else optim.decay_fraction
    return max(1, round(fraction * max_steps))


def scheduled_lr(step: int, optim: Any, max_steps: int, *, lr: float | None = None) -> float:
    """The learning rate ``optim`` (an ``OptimConfig``) schedules at ``step`` of a run of ``max_steps`` steps."""
    peak = optim.lr if lr is None else lr
    common = dict(warmup_steps=optim.warmup_steps, max_steps=max_steps, lr=peak, min_lr=optim.min_lr)
    if optim.schedule == "wsd":
        return wsd(step, **common, decay_steps=decay_length(optim, max_steps), shape=optim.decay_shape)
    return warmup_cosine(step, **common, schedule=optim.schedule)


def check_schedule_fits(optim: Any, max_steps: int, prefix: str = "", steps_key: str = "trainer.max_steps") -> None:
    """A WSD warmup and cooldown that do not fit in the run's ``max_steps`` are refused in one line naming the keys."""
    if optim.schedule != "wsd":
        return
    decay = decay_length(optim, max_steps)
    if optim.warmup_steps + decay > max_steps:
        given = f"{prefix}decay_steps" if optim.decay_steps is not None else f"{prefix}decay_fraction"
        raise ConfigError(
            f"{prefix}warmup_steps ({optim.warmup_steps}) + the WSD cooldown ({decay} steps, {given}) exceed "
            f"{steps_key} ({max_steps}): shorten the cooldown or the warmup, or train longer"
        )


def check_resumed_optim(config: Any, header: dict[str, Any], path: str) -> None:
    """Before a run resumes checkpoint ``path`` (its ``header``): every optim section must name the optimizer the
    checkpoint's state is of, and a WSD schedule must give the checkpoint's step the rate the checkpoint's own run
    gave it (a cooldown branched from a stable-phase checkpoint into a shorter run does; one branched past its own
    cooldown's start would jump). One line each."""
    saved = (header.get("hyper_parameters") or {}).get("config") or {}
    trainer, step = getattr(config, "trainer", None), header.get("global_step")
    if not saved or trainer is None or not hasattr(config, "optim_sections"):
        return
    steps = config.schedule_steps()
    per_step = steps // trainer.max_steps  # an RL rollout makes several updates; the schedule counts those
    for key, optim in config.optim_sections().items():
        was = saved.get(key) or {}
        if was.get("name", "adamw") != optim.name:
            raise ConfigError(
                f"checkpoint.resume: {path} holds {was.get('name', 'adamw')}'s optimizer state but this run has "
                f"{key}.name {optim.name}: resume it with {key}.name={was.get('name', 'adamw')}"
            )
        saved_steps = ((saved.get("trainer") or {}).get("max_steps") or 0) * per_step
        if optim.schedule != "wsd" or not isinstance(step, int) or not saved_steps:
            continue
        before = SimpleNamespace(**{**vars(type(optim)()), **was})  # the checkpoint's section over the defaults
        now = scheduled_lr(step * per_step, optim, steps) / optim.lr
        then = scheduled_lr(step * per_step, before, saved_steps) / before.lr
        if not math.isclose(now, then, rel_tol=1e-9):
            start = (steps - decay_length(optim, steps)) // per_step
            raise ConfigError(
                f"checkpoint.resume: {path} is at step {step}, where its run's learning rate was {then:.3g} x lr but "
                f"this run's WSD schedule gives {now:.3g} x lr (its cooldown starts at step {start}): branch a "
                f"cooldown from a stable-phase checkpoint at or before step {start}"
            )
