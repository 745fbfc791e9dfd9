"""The LightningModule every stage subclasses: one step path (loss normalisation, NaN/Inf guard, clipping, step
counting) for automatic and manual optimisation alike, the step and validation accounting, and checkpoints under
plain parameter names that hold only what trains."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from models.adapters import trained_names
from models.errors import CheckpointError, NonFiniteLossError
from models.model_config import PeftConfig, adapter_config, lantern_targets
from trainer.optim import optimizer_from_config
from trainer.parallel import configure_parallelism, first_non_finite, grad_norm_and_clip, plain_name

log = logging.getLogger(__name__)


class LanguageModelModule(L.LightningModule):
    """``config`` has ``optim`` and ``trainer`` sections; ``self.model`` is what trains. A stage declares
    ``step_metrics`` (a step's means, added up by ``loss_to_backpropagate``), ``validation_sums`` (sums over ranks,
    divided by ``validation_metrics``) and ``progress_bar`` (the names the bar shows). Several validation loaders
    (a pretraining mixture's sources) are named by ``validation_sets``: each is reported as ``val/SET/NAME`` too."""

    step_metrics: tuple[str, ...] = ()
    validation_sums: tuple[str, ...] = ()
    progress_bar: tuple[str, ...] = ()
    validation_sets: tuple[str, ...] = ()  # one name per validation dataloader (dataloader_idx); () for one
    # each set's share of the overall val/NAME (its sums rescaled to that share of the count); (): the sums pooled
    validation_set_weights: tuple[float, ...] = ()

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model: nn.Module | None = None
        self.failed = False
        self.bar_metrics: dict[str, None] = {}  # training values the progress bar shows (``log``), in order
        self._step_values: list[tuple[str, Tensor]] = []  # what the optimizer step's NaN/Inf check looks at
        self.grad_norms: dict[str, float] = {}  # manual optimisation: each module's gradient norm at its last update
        # attribute (``model``, PPO's ``critic``) -> its base: {"checkpoint": folder or None, "fingerprint", ...}
        self.adapter_bases: dict[str, dict[str, Any]] = {}
        self._resumed_rng: Mapping[str, Any] | None = None  # a checkpoint's RNG state, until the first step
        self._training_rng: Mapping[str, Any] | None = None  # the RNG state after the latest step, for validation

    def build_model(self) -> nn.Module:
        """Called under the meta device when the subclass left ``self.model`` unset (trainer.init_device=meta)."""
        raise NotImplementedError(f"{type(self).__name__} builds its model in __init__")

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = self.build_model()
        configure_parallelism(self.model, self.trainer, self.config.trainer)

    def log(self, name: str, value: Any, prog_bar: bool = False, **kwargs: Any) -> None:
        """Lightning's ``log``; a training value for the progress bar is logged as any other and read by the bar at
        logging steps only (Lightning would read it, a host sync, after every micro-batch)."""
        if prog_bar and self._trainer is not None and self.trainer.training:
            self.bar_metrics[name] = None
            prog_bar = False
        super().log(name, value, prog_bar=prog_bar, **kwargs)

    # ---- the step path: every stage's micro-batches and updates, automatic and manual optimisation alike ----

    def sum_over_ranks(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over ranks (itself in one process): the global counts that losses are divided by."""
        return self.trainer.strategy.reduce(tensor, reduce_op="sum") if self.trainer.world_size > 1 else tensor

    def loss_to_backpropagate(self, share: Tensor, metrics: Tensor | None = None) -> Tensor:
        """What to backpropagate for a micro-batch whose loss is ``share``: its sum divided by the optimizer step's
        global count (tokens, pairs or weights over all ranks and micro-batches). Notes ``share`` for the step's
        NaN/Inf check, adds ``metrics`` (default: ``share``) to the ``step_metrics`` sums, and undoes the ranks'
        gradient averaging and Lightning's accumulation division, so the gradient is that of the step's loss."""
        self.stop_if_not_finite(share)
        if self.step_metrics:
            self._step_sums += share.detach() if metrics is None else metrics
        # manual optimisation (RL) has no accumulation division: Lightning refuses accumulate_grad_batches > 1 there
        return share * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def stop_if_not_finite(self, value: Tensor, what: str = "loss") -> None:
        """Note ``value`` (a loss, or what an update depends on: "reward", "policy gradient norm") for the step's
        NaN/Inf check, on the device: nothing is read until ``check_finite_step``."""
        self._step_values.append((what, value.detach().float()))

    def check_finite_step(self) -> bool:
        """Once before each update: stop the run when a noted value is NaN/Inf, or, with
        ``trainer.max_nonfinite_steps`` = N > 0, skip up to N steps in a row (``skip_step``: the update's gradients
        are dropped). Returns whether this update is skipped. One host read, one all-reduce under several ranks."""
        step, noted = self.global_step, self._step_values
        self._step_values = []
        if not noted:  # checked already, or nothing noted in this step
            return False
        first = first_non_finite([value for _, value in noted], self.trainer)
        if first is None:
            return False
        what, value = noted[first]  # the step's first non-finite value (on this rank, if here)
        bad = ~torch.isfinite(value)
        if value.numel() == 1 or not bad.any():
            described = f"{what} is {value.flatten()[0].item() if bad.any() else 'not finite on another rank'}"
        else:
            described = f"{what} is {value[bad].flatten()[0].item()} for {int(bad.sum())} of {value.numel()} values"
        allowed = self.config.trainer.max_nonfinite_steps
        first, count = getattr(self, "_nonfinite_run", (step, 0))  # the current run of consecutive bad steps
        if step == first + count:  # the next step (or the first bad one): the run goes on
            count += 1
        elif step != first + count - 1:  # a later update of the same step (RL) does not lengthen the run
            first, count = step, 1
        self._nonfinite_run = (first, count)
        if count > allowed:
            self.failed = True
            in_a_row = f" after {count - 1} skipped in a row (trainer.max_nonfinite_steps={allowed})" if allowed else ""
            raise NonFiniteLossError(f"{described} at step {step}{in_a_row}: {self._after_non_finite()}")
        self.skip_step = step
        log.warning(
            "%s at step %d: step skipped (%d of trainer.max_nonfinite_steps=%d in a row)",
            described,
            step,
            count,
            allowed,
        )
        return True

    def _after_non_finite(self) -> str:
        """What a stop on a non-finite value leaves and what to do: the newest checkpoint, if there is one."""
        from trainer.checkpoints import latest_checkpoint  # deferred: only on the way out

        advice = "lower optim.lr (a rerun trains at the new one), enable optim.grad_clip or check the data"
        trainer = self._trainer  # None outside a Trainer (a step driven by hand)
        folder = Path(getattr(trainer, "default_root_dir", None) or ".") / "checkpoints"
        newest = latest_checkpoint(folder, verified=False)
        if newest is None:
            return (
                f"training stopped before this update, before any checkpoint was written (none in {folder}): a "
                f"rerun starts over; {advice}"
            )
        return (
            "training stopped before this update; checkpoints are never written with a non-finite tensor, so "
            f"{newest} is the last good step and a rerun resumes from it; {advice}"
        )

    def on_train_start(self) -> None:
        self._step_sums = torch.zeros(len(self.step_metrics), device=self.device)
        self._step_values = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.check_finite_step()  # done already by SkipNonFiniteSteps where it is a callback (it runs first)
        if not self.step_metrics:
            return
        # shares summed over micro-batches here and over ranks by the sync: the step's means over all of it
        for name, value in zip(self.step_metrics, self._step_sums.clone()):
            self.log(
                f"train/{name}",
                value,
                on_step=True,
                on_epoch=False,
                prog_bar=name in self.progress_bar,
                sync_dist=True,
                reduce_fx="sum",
            )
        self._step_sums.zero_()

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        norm = grad_norm_and_clip(self.model.parameters(), self.config.optim.grad_clip)
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False, rank_zero_only=True)

    def apply_update(self, *updates: tuple[Any, Any, nn.Module, float | None, str]) -> None:
        """One update under manual optimisation, on the automatic path's pieces: each (optimizer, schedule,
        module, max_norm, name) has its gradients clipped (``grad_norms[name]``: the norm, also checked), then,
        after ``check_finite_step``, every optimizer steps or, when the update is skipped, none changes anything.
        The schedules advance either way."""
        norms = [grad_norm_and_clip(module.parameters(), max_norm) for _, _, module, max_norm, _ in updates]
        for (*_, name), norm in zip(updates, norms):
            self.stop_if_not_finite(norm, f"{name} gradient norm")
        skipped = self.check_finite_step()
        for (optimizer, schedule, _, _, name), norm in zip(updates, norms):
            self.grad_norms[name] = float(norm)
            if skipped:  # as SkipNonFiniteSteps does: no gradients, so the step changes no weight and no state
                optimizer.zero_grad(set_to_none=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()

    def count_global_step(self) -> None:
        """Under manual optimisation, end one global step (an RL rollout, whatever number of updates it made): the
        unit of trainer.max_steps, checkpoint intervals and plots."""
        # Lightning counts only LightningOptimizer.step() calls and has no public counter for manual steps
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()

    # ---- validation: sums over batches, one all-reduce, then the division ----

    def on_validation_epoch_start(self) -> None:
        # sums and counts, not a mean of batch means, so that a reported mean is the true one; a row per set
        sets = max(len(self.validation_sets), 1)
        self._validation_totals = torch.zeros(sets, len(self.validation_sums), device=self.device)

    def add_validation_sums(self, sums: Tensor, dataloader_idx: int = 0) -> None:
        """Add a batch's sums, in ``validation_sums`` order, to its validation set's."""
        self._validation_totals[dataloader_idx] += sums

    def on_validation_epoch_end(self) -> None:
        if not self.validation_sums:
            return
        rows = self.trainer.strategy.reduce(self._validation_totals, reduce_op="sum").tolist()
        metrics = self.validation_set_metrics([dict(zip(self.validation_sums, row)) for row in rows])
        for name, value in metrics.items():  # already reduced over ranks: the sync averages equal values
            self.log(f"val/{name}", value, prog_bar=name in self.progress_bar, sync_dist=True)

    def validation_set_metrics(self, rows: list[dict[str, float]]) -> dict[str, float]:
        """``val/NAME`` over every set (pooled, or each set rescaled to its ``validation_set_weights`` share of the
        count), then ``val/SET/NAME`` per named set that counted anything."""
        count = self.validation_sums[-1]
        present = [(index, row) for index, row in enumerate(rows) if row[count] > 0] or list(enumerate(rows))
        totals = {name: sum(row[name] for _, row in present) for name in self.validation_sums}
        if self.validation_set_weights and len(rows) > 1:
            weights = [self.validation_set_weights[index] for index, _ in present]
            scale = [w / sum(weights) * totals[count] / max(row[count], 1) for w, (_, row) in zip(weights, present)]
            totals = {name: sum(s * row[name] for s, (_, row) in zip(scale, present)) for name in self.validation_sums}
        metrics = self.validation_metrics(totals)
        for index, row in present if self.validation_sets else ():
            if row[count] > 0:
                named = self.validation_metrics(row).items()
                metrics |= {f"{self.validation_sets[index]}/{name}": value for name, value in named}
        return metrics

    def validation_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The ``val/NAME`` metrics (by NAME) from ``validation_sums``' totals over all ranks: by default every sum
        but the last divided by the last (a count, at least 1)."""
        *sums, count = self.validation_sums
        return {name: totals[name] / max(totals[count], 1) for name in sums}

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer, schedule = optimizer_from_config(self.model, self.config.optim, self.config.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load weights saved under plain names (or any other wrappers' names) into this module as wrapped now;
        every checkpoint load, single-process and FSDP2, comes through here."""
        state_dict = self._to_wrapped_names(state_dict)
        # A checkpoint of another model would fail in load_state_dict with a screenful of size mismatches.
        current = super().state_dict(keep_vars=True)
        mismatched = [
            f"{plain_name(name)}: checkpoint {tuple(value.shape)} vs model {tuple(current[name].shape)}"
            for name, value in state_dict.items()
            if isinstance(value, Tensor) and name in current and value.shape != current[name].shape
        ]
        if mismatched:
            raise CheckpointError(
                f"the checkpoint being resumed holds another model ({len(mismatched)} tensors of other shapes: "
                f"{'; '.join(mismatched[:3])}): resume it with the model it was trained with"
            )
        if not self.adapter_bases:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        # an adapters' checkpoint holds what trains: the base's tensors come from the base, loaded already
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        trained = self._trained_names()
        # by plain name: missing_keys name the modules as wrapped (activation checkpointing's prefix included),
        # which state_dict() names do not
        missing = [name for name in result.missing_keys if self._checkpointed(plain_name(name), trained)]
        if strict and (missing or result.unexpected_keys):
            raise CheckpointError(
                f"the checkpoint being resumed does not match this run's adapters: missing {missing[:3]}, "
                f"unexpected {result.unexpected_keys[:3]} (resume with the peft section it was trained with)"
            )
        return result

    def _checkpointed(self, name: str, trained: set[str]) -> bool:
        """Whether a checkpoint holds the tensor of this plain name: all of them, except, in a module with
        adapters, the base's frozen ones (``trained``: ``_trained_names()``)."""
        return name.split(".", 1)[0] not in self.adapter_bases or name in trained

    def _trained_names(self) -> set[str]:
        return {plain_name(name) for name in trained_names(self)}

    def check_adapter_checkpoint(self, checkpoint: Mapping[str, Any], path: Any) -> None:
        """Refuse, in one line naming ``path``, a checkpoint whose adapters were trained on another base (or with
        another peft section), and one with or without adapters where this run has the opposite."""
        saved = checkpoint.get("adapters") or {}
        if not saved and not self.adapter_bases:
            return
        if set(saved) != set(self.adapter_bases):
            has = "holds LoRA adapters" if saved else "holds a fully trained model"
            wants = "adds adapters (peft.kind=lora)" if self.adapter_bases else "has peft.kind=none"
            raise CheckpointError(
                f"{path} {has} but this run {wants}: resume with the peft section it was trained with"
            )
        for attribute, base in self.adapter_bases.items():
            record = saved[attribute]
            if record["fingerprint"] != base["fingerprint"]:
                raise CheckpointError(
                    f"{path}: its adapters ({attribute}) were trained on {describe_base(record)} (fingerprint "
                    f"{record['fingerprint']}), this run's base is {describe_base(base)} (fingerprint "
                    f"{base['fingerprint']}): resume it on the base it was trained on"
                )
            configured = asdict(adapter_config(getattr(self, attribute)))
            if same_adapters(record.get("peft") or {}) != same_adapters(configured):
                raise CheckpointError(
                    f"{path}: its adapters ({attribute}) are peft {record.get('peft')}, this run's section is "
                    f"{configured}: resume with the peft section it was trained with"
                )

    def _to_wrapped_names(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        # keep_vars: names only, no detached copies; FSDP2's local shards need no collective for this.
        current = super().state_dict(keep_vars=True).keys()
        wrapped = {plain_name(name): name for name in current}
        return {
            (name if name in current else wrapped.get(plain_name(name), name)): value
            for name, value in state_dict.items()
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # torch.compile's ``_orig_mod.`` is in nn.Module.state_dict() names (FSDP2's DCP state dicts strip it
        # already): save plain names, which load_state_dict maps back onto whatever wraps the blocks then.
        if "state_dict" in checkpoint:
            trained = self._trained_names()
            checkpoint["state_dict"] = {
                plain_name(name): value
                for name, value in checkpoint["state_dict"].items()
                if self._checkpointed(plain_name(name), trained)
            }
        if self.adapter_bases:
            checkpoint["adapters"] = {
                attribute: {**base, "peft": asdict(adapter_config(getattr(self, attribute)))}
                for attribute, base in self.adapter_bases.items()
            }
        # saved from inside a validation (a callback's error there): the state training resumes from, before it
        validating = self._training_rng is not None and self._trainer is not None and self.trainer.validating
        checkpoint["rng"] = self._training_rng if validating else rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # single-process loads call this before the weights; FSDP2's loader checks the adapters first itself
        self.check_adapter_checkpoint(checkpoint, self.trainer.ckpt_path if self._trainer is not None else "checkpoint")
        state = checkpoint.get("rng")
        if state:
            set_rng_state(state)
            self._resumed_rng = state

    # ---- the global RNG that training draws from (LoRA's dropout) is the same straight and resumed ----

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first step of a resumed run starts from the checkpoint's RNG state: between the load and here,
        Lightning draws from it (a dataloader iterator's seed), where the uninterrupted run did not."""
        if self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)
            self._resumed_rng = None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # after the step's checkpoint (callbacks run first), before a validation that may follow
        self._training_rng = rng_state()

    def on_validation_end(self) -> None:
        """Validation during training (its dataloader's seed, sampled generations) leaves the RNG where training
        left it: a run resumed from the checkpoint of a step that validated continues as the uninterrupted one."""
        if self._training_rng is not None and self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            set_rng_state(self._training_rng)
        self._training_rng = None


def rng_state() -> dict[str, Any]:
    """The global RNGs' state (torch's CPU and CUDA generators, Python's), as checkpoints keep it."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def describe_base(record: Mapping[str, Any]) -> str:
    """An adapters' base, from its record: its folder, or its seed."""
    return record.get("checkpoint") or f"the model seeded with run.seed={record.get('seed')}"


def same_adapters(peft: Mapping[str, Any]) -> dict[str, Any]:
    """A peft section as it shapes the adapters: its targets by Lantern's names, in any order."""
    return {**peft, "target_modules": sorted(lantern_targets(PeftConfig(**peft)))} if peft else {}
