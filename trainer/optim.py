"""The optimizer of every stage: AdamW with decay on matrices only, or Muon for the transformer blocks' matrices with
AdamW for the rest (``trainer/muon.py``), under a warmup-cosine, constant or WSD schedule
(``trainer/optim_config.py``)."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from models.errors import ConfigError
from trainer.config import OptimConfig
from trainer.muon import MuonWithAdamW, muon_parameters
from trainer.optim_config import scheduled_lr, warmup_cosine

__all__ = ["OptimSettingsOnResume", "build_optimizer", "optimizer_from_config", "parameter_groups", "warmup_cosine"]

log = logging.getLogger(__name__)


def parameter_groups(
    model: nn.Module, weight_decay: float, decay_embeddings_and_norms: bool = False, exclude: list[Tensor] = ()
) -> list[dict]:
    """Weight decay on 2-D projection matrices; norms (1-D) and, unless asked, embeddings are not decayed. Parameters
    in ``exclude`` (Muon's) are left out.

    Decaying a norm's gain pulls it toward 0 instead of its natural 1, and decaying embeddings shrinks rare
    tokens' vectors that get few gradient updates.
    """
    decay, no_decay = [], []
    seen: set[int] = {id(p) for p in exclude}
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:  # tied weights appear twice
            continue
        seen.add(id(param))
        is_embedding = "tok_embeddings" in name
        if (param.ndim >= 2 and (not is_embedding or decay_embeddings_and_norms)) or (
            param.ndim < 2 and decay_embeddings_and_norms
        ):
            decay.append(param)
        else:
            no_decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    min_lr: float,
    weight_decay: float,
    betas: tuple[float, float] | list[float],
    eps: float,
    warmup_steps: int,
    max_steps: int,
    decay_embeddings_and_norms: bool = False,
    schedule: str = "cosine",
    **settings: Any,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """``optimizer_from_config`` with the optim section's keys as arguments (``settings``: any other, e.g. ``name``,
    ``decay_steps``, ``muon``)."""
    optim = OptimConfig(
        lr=lr, min_lr=min_lr, weight_decay=weight_decay, betas=list(betas), eps=eps, warmup_steps=warmup_steps,
        decay_embeddings_and_norms=decay_embeddings_and_norms, schedule=schedule, **settings,  # type: ignore[arg-type]
    )  # fmt: skip
    return optimizer_from_config(model, optim, max_steps)


def optimizer_from_config(
    model: nn.Module, optim: OptimConfig, max_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer ``optim`` names over ``model``'s trainable parameters, and its schedule over ``max_steps``
    optimizer steps (one LambdaLR: every group follows the schedule as a multiple of its own initial lr)."""
    matrices = muon_parameters(model) if optim.name == "muon" else []
    if optim.name == "muon" and not matrices:
        raise ConfigError(
            "optim.name 'muon': this model has no trainable transformer-block matrices for Muon (LoRA trains only "
            "low-rank factors): use optim.name adamw"
        )
    # fused AdamW: one kernel a step on CUDA, and on CPU (a CPU run, or trainer.cpu_offload's step on the host) 7x
    # faster than the foreach default (50M parameters: 13 vs 98 ms on 2 cores; docs/plan.md), equal within 1e-6
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(
        parameter_groups(model, optim.weight_decay, optim.decay_embeddings_and_norms, exclude=matrices),
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        fused=True,
    )
    if matrices:
        optimizer = MuonWithAdamW(optimizer, muon_optimizer(matrices, optim))
    peak = optim.lr
    # a closure, not a callable object: LambdaLR does not save it, so a run resumed (or a cooldown branched) with
    # another length follows its own schedule from the restored step
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: scheduled_lr(step, optim, max_steps) / peak)
    return optimizer, schedule


def muon_optimizer(matrices: list[Tensor], optim: OptimConfig) -> torch.optim.Muon:
    """``torch.optim.Muon`` over ``matrices`` with ``optim.muon``'s settings (its lr and weight decay default to
    optim's: under ``match_rms_adamw`` an update has AdamW's RMS, so AdamW's tuned values carry over)."""
    muon = optim.muon
    return torch.optim.Muon(
        matrices,
        lr=optim.lr if muon.lr is None else muon.lr,
        weight_decay=optim.weight_decay if muon.weight_decay is None else muon.weight_decay,
        momentum=muon.momentum,
        nesterov=muon.nesterov,
        ns_steps=muon.ns_steps,
        adjust_lr_fn=muon.adjust_lr_fn,
    )


class OptimSettingsOnResume(L.Callback):
    """A resumed run trains with its own config's optimizer settings (lr and the schedule, weight decay, betas, eps,
    Muon's), not the checkpoint's: Lightning restores each param group's hyperparameters and the scheduler's base
    rates with the optimizer state, so `optim.lr=1e-5` on a resume of a 1e-3 run trained at 1e-3 (and advice to
    lower the lr after a divergence could not work). The optimizer state (Adam's moments, Muon's momentum) and the
    step are kept; what changed is logged."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after configure_optimizers, before the checkpoint's state is restored: the settings this config asks for
        self._configured = [
            [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
            for optimizer in trainer.optimizers
        ]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        configured, self._configured = getattr(self, "_configured", None), None
        if not trainer.ckpt_path or configured is None:
            return
        changed: dict[str, tuple[Any, Any]] = {}
        for optimizer, groups in zip(trainer.optimizers, configured, strict=True):
            for group, wanted in zip(optimizer.param_groups, groups, strict=True):
                for key, value in wanted.items():
                    if key != "lr" and group.get(key) != value:
                        changed.setdefault("lr" if key == "initial_lr" else key, (group.get(key), value))
                    if key != "lr":
                        group[key] = value
        for config in trainer.lr_scheduler_configs:  # the schedule from the restored step, over the new base rates
            schedule = config.scheduler
            if isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
                schedule.base_lrs = [group["initial_lr"] for group in schedule.optimizer.param_groups]
                rates = [
                    base * scale(schedule.last_epoch) for scale, base in zip(schedule.lr_lambdas, schedule.base_lrs)
                ]
                for group, rate in zip(schedule.optimizer.param_groups, rates, strict=True):
                    group["lr"] = rate
                schedule._last_lr = rates
        if changed:
            said = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changed.items())
            log.warning("resumed with this config's optimizer settings, not the checkpoint's: %s", said)
