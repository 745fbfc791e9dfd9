"""The ``optim`` section every training stage has (``OptimConfig``, with Muon's settings in ``MuonConfig``) and the
rules across it and the stage's other sections, checked at load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from models.config_checks import bounded
from models.errors import ConfigError
from trainer.schedules import check_schedule_fits


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
