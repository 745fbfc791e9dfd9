"""Pretraining: next-token loss over packed windows of prepared token shards (``PretrainModule``), and its recipe
``run_pretrain``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from alignment.schemas.pretrain import PretrainConfig
from alignment.shared.initial_model import load_initial_model
from alignment.stages.registry import PRETRAIN, Stage
from data.pretrain.datamodule import PretrainDataModule
from data.pretrain.mixture import check_prepared
from data.streams.mixture import normalised
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import load_checkpoint
from models.generation import complete
from models.loss import IGNORE_INDEX
from models.model import Transformer
from trainer.build import check_stage_config, fit_stage, stage_callbacks, start_run_directory
from trainer.callbacks import LossPlot
from trainer.config import to_dict
from trainer.lm_module import LanguageModelModule
from trainer.model_sources import require_source, source_model_config


class PretrainModule(LanguageModelModule):
    """A mixture (``data.sources``) is validated per source, ``val/NAME/loss`` (token average), and ``val/loss`` is
    the sources' losses weighted by their shares: the loss on the mixture training draws from."""

    step_metrics = ("loss",)
    validation_sums = ("loss", "tokens")  # sum and count: the reported loss is the true token average
    progress_bar = ("loss", "perplexity")

    def __init__(self, config: PretrainConfig, model: Transformer | None = None) -> None:
        """``model``: the checkpoint continued (``init.checkpoint``), else a new one built from ``config.model``."""
        super().__init__(config)
        self.save_hyperparameters({"config": to_dict(config)})
        if config.data.sources:  # one validation loader per source, in config order (the datamodule's)
            shares = normalised({source.name: source.weight for source in config.data.sources})
            self.validation_sets, self.validation_set_weights = tuple(shares), tuple(shares.values())
        if model is not None:
            self.model = model
        elif config.trainer.init_device == "cpu":
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

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        losses = self._losses(batch)
        sums = torch.stack([losses.sum(), (batch["targets"] != IGNORE_INDEX).sum().float()])
        self.add_validation_sums(sums, dataloader_idx)  # dataloader_idx: a mixture's source

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
        sources={source.name: source.weight for source in config.data.sources} or None,
    )


def run_pretrain(
    config: PretrainConfig, extra_callbacks: list[L.Callback] | None = None, *, stage: Stage = PRETRAIN
) -> Path | None:
    """Check everything that can be checked, then train; returns the run folder (None on ranks other than 0).

    Under a multi-process strategy Lightning re-runs the command in each new process, so everything here is
    repeated per rank and must be idempotent.
    """
    if config.init.checkpoint:
        require_source(config.init.checkpoint, "init.checkpoint")
    # before anything is created; data.tokenizer: auto is init.checkpoint's
    check_stage_config(config, stage.model_folders(config))
    if config.init.checkpoint:  # continued pretraining: the checkpoint's shape (a conflicting section was refused)
        config.model = dataclasses.replace(
            source_model_config(config.init.checkpoint), attention=config.model.attention
        )
    plan = stage.preflight(config)
    tokenizer = Tokenizer.load(config.data.tokenizer)
    stage.check_row_tokens(config, config.model.max_seq_len, "model.max_seq_len")
    check_prepared(config.data, tokenizer)  # each source of a mixture: prepared, by this tokenizer, not empty
    datamodule = pretrain_datamodule(config)
    try:
        datamodule.setup("fit")  # builds the datasets now: a split shorter than one sequence fails before launch
        model = None
        if config.init.checkpoint:
            model = load_initial_model(config)  # its tokenizer was checked against it by check_stage_config
            model.config.attention = config.model.attention

        # data_stats.json records what the run reads, by content (fingerprint and inputs), not only data.source's words
        run_dir = start_run_directory(config, "pretrain", data_stats={"prepared": datamodule.prepared})
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
            LossPlot(
                run_dir,
                ("train/loss", "val/loss", *(f"val/{source.name}/loss" for source in config.data.sources)),
                title=f"pretraining: {config.run.name}",
            ),
            *(extra_callbacks or []),
        ]
        if fit_stage(config, PretrainModule(config, model), datamodule, run_dir, callbacks, plan=plan) is None:
            return None  # not rank 0
    finally:
        datamodule.teardown()  # however the run ended, its data folders are free for a rebuild again
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
