"""Pretraining: next-token loss over packed windows of prepared token shards (``PretrainModule``), and its recipe
``run_pretrain``."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from alignment.schemas.pretrain import PretrainConfig
from alignment.stages.registry import stage_named
from data.pretrain.datamodule import PretrainDataModule
from data.pretrain.manifest import check_manifest
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import load_checkpoint
from models.generation import complete
from models.loss import IGNORE_INDEX
from models.model import Transformer
from trainer.build import check_stage_config, fit_stage, stage_callbacks, start_run_directory
from trainer.callbacks import LossPlot
from trainer.config import to_dict
from trainer.lm_module import LanguageModelModule


class PretrainModule(LanguageModelModule):
    step_metrics = ("loss",)
    validation_sums = ("loss", "tokens")  # sum and count: the reported loss is the true token average
    progress_bar = ("loss", "perplexity")

    def __init__(self, config: PretrainConfig) -> None:
        super().__init__(config)
        self.save_hyperparameters({"config": to_dict(config)})
        if config.trainer.init_device == "cpu":
            # Built eagerly and seeded, so every rank and a single-process run start from identical weights.
            torch.manual_seed(config.run.seed)
            self.model = Transformer(config.model)

    def build_model(self) -> Transformer:
        return Transformer(self.config.model)

    def _losses(self, batch: dict[str, Tensor]) -> Tensor:
        return self.model.token_losses(
            batch["input_ids"],
            batch["targets"],
            document_ids=batch.get("document_ids"),
            z_loss=self.config.optim.z_loss,
            chunk_size=self.config.trainer.loss_chunk_size,
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        # the step's tokens are not known before its last micro-batch: each micro-batch counts for 1 / accumulation
        tokens = self.sum_over_ranks((batch["targets"] != IGNORE_INDEX).sum().float()).clamp(min=1)
        step_tokens = tokens * self.trainer.accumulate_grad_batches
        return self.loss_to_backpropagate(self._losses(batch).sum() / step_tokens)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        losses = self._losses(batch)
        self.add_validation_sums(torch.stack([losses.sum(), (batch["targets"] != IGNORE_INDEX).sum().float()]))

    def validation_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        loss = super().validation_metrics(totals)["loss"]
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def pretrain_datamodule(config: PretrainConfig):
    """The packed-window datamodule a pretraining config describes."""

    return PretrainDataModule(
        config.data.out_dir,
        config.loader.seq_len,
        config.loader.micro_batch_size,
        document_masking=config.loader.document_masking,
        seed=config.run.seed,
        num_workers=config.loader.num_workers,
        val_batches=config.loader.val_batches,
    )


def run_pretrain(config: PretrainConfig, extra_callbacks: list[L.Callback] | None = None) -> Path | None:
    """Check everything that can be checked, then train; returns the run folder (None on ranks other than 0).

    Under a multi-process strategy Lightning re-runs the command in each new process, so everything here is
    repeated per rank and must be idempotent.
    """
    check_stage_config(config)  # before anything is created
    plan = stage_named("pretrain").preflight(config)
    tokenizer = Tokenizer.load(config.data.tokenizer)
    stage_named("pretrain").check_row_tokens(config, config.model.max_seq_len, "model.max_seq_len")
    check_manifest(config.data.out_dir, tokenizer)
    datamodule = pretrain_datamodule(config)
    datamodule.setup("fit")  # builds the datasets now: a split shorter than one sequence fails before launch

    run_dir = start_run_directory(config, "pretrain")
    callbacks = [
        *stage_callbacks(
            config,
            run_dir,
            tokenizer,
            metadata={"stage": "pretrain", "tokenizer": str(tokenizer.path)},
            throughput=(
                config.loader.micro_batch_size * config.loader.seq_len,
                config.model.flops_per_token(config.loader.seq_len),
            ),
        ),
        LossPlot(run_dir, title=f"pretraining: {config.run.name}"),
        *(extra_callbacks or []),
    ]
    if fit_stage(config, PretrainModule(config), datamodule, run_dir, callbacks, plan=plan) is None:
        return None  # not rank 0
    if config.sample.prompt:
        print_sample(run_dir / "final", tokenizer, config.sample)
    return run_dir


def print_sample(checkpoint: Path, tokenizer, sample) -> None:

    model = load_checkpoint(checkpoint, dtype=torch.float32)
    prompt = tokenizer.encode(sample.prompt, bos=True)
    text = complete(
        model,
        tokenizer,
        prompt,
        max_new_tokens=sample.max_new_tokens,
        temperature=sample.temperature,
        generator=torch.Generator().manual_seed(0),
        heal=True,  # a prompt such as "ROMEO:" ends inside a merged token (':\n')
    )
    print(f"\n--- sample from {checkpoint} ---\n{sample.prompt}{text}\n---")
