"""What every stage's LightningModule shares: parallelism, optimiser and schedule, gradient clipping with a
logged norm, the NaN/Inf stop, and RNG state in checkpoints. Stages subclass it and write their steps."""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from trainer.errors import NonFiniteLossError
from trainer.optim import build_optimizer
from trainer.parallel import configure_parallelism, grad_norm_and_clip


class LanguageModelModule(L.LightningModule):
    """``config`` has ``optim`` (OptimConfig) and ``trainer`` (TrainerConfig) sections; ``self.model`` is the
    module that is trained (built by the subclass, or on the meta device in ``build_model``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model: nn.Module | None = None
        self.failed = False

    def build_model(self) -> nn.Module:
        """Called under the meta device when the subclass left ``self.model`` unset (trainer.init_device=meta)."""
        raise NotImplementedError(f"{type(self).__name__} builds its model in __init__")

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = self.build_model()
        configure_parallelism(self.model, self.trainer, self.config.trainer)

    def stop_if_not_finite(self, loss: Tensor) -> None:
        finite = torch.isfinite(loss.detach()).float()
        # Every rank must agree, or one rank would raise while the others wait in a collective.
        if self.trainer.world_size > 1:
            finite = self.trainer.strategy.reduce(finite, reduce_op="min")
        if finite.item() < 1:
            self.failed = True
            raise NonFiniteLossError(
                f"loss is {loss.item()} at step {self.global_step}: training stopped; the last good checkpoint "
                "is kept (lower optim.lr, enable optim.grad_clip or check the data)"
            )

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        norm = grad_norm_and_clip(self.model.parameters(), self.config.optim.grad_clip)
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False, rank_zero_only=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optim = self.config.optim
        optimizer, schedule = build_optimizer(
            self.model,
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            betas=tuple(optim.betas),
            eps=optim.eps,
            warmup_steps=optim.warmup_steps,
            max_steps=self.config.trainer.max_steps,
            decay_embeddings_and_norms=optim.decay_embeddings_and_norms,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            checkpoint["rng"]["cuda"] = torch.cuda.get_rng_state_all()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("rng")
        if state:
            torch.set_rng_state(state["torch"])
            random.setstate(state["python"])
            if "cuda" in state and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["cuda"])
