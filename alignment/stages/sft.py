"""Supervised fine-tuning (``SFTModule``, ``run_sft``): next-token loss on the assistant turns of chat examples,
averaged over the step's tokens or its examples (``loss.reduction``); validation reports loss by answer length and
the exact match of greedy answers."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor

from alignment.schemas.sft import SFTConfig
from alignment.shared.evaluation import answer_prompts, exact_match
from alignment.shared.initial_model import add_stage_adapters, load_initial_model
from alignment.stages.registry import SFT, Stage
from data.sft.datamodule import SFTDataModule
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError
from models.loss import IGNORE_INDEX
from models.model import Transformer
from trainer.build import check_stage_config, fit_stage, stage_callbacks, start_run_directory
from trainer.callbacks import LossPlot
from trainer.checks import check_initial_model
from trainer.config import to_dict
from trainer.lm_module import LanguageModelModule
from trainer.parallel import unsharded_for_generation
from trainer.plan_check import PlannedRun

log = logging.getLogger(__name__)

KINDS = ("short", "long")


def per_example_mean(token_losses: Tensor, targets: Tensor, document_ids: Tensor) -> Tensor:
    """Mean loss of each example (document) over its supervised tokens, (num_examples,).

    Examples are keyed by (row, document id), so packed rows split into their examples; examples without a
    supervised token do not appear.
    """
    batch, seq_len = targets.shape
    valid = targets != IGNORE_INDEX
    keys = (torch.arange(batch, device=targets.device)[:, None] * (seq_len + 1) + document_ids)[valid]
    _, example_index = torch.unique(keys, return_inverse=True)
    count = int(example_index.max()) + 1 if example_index.numel() else 0
    sums = torch.zeros(count, device=token_losses.device, dtype=token_losses.dtype).index_add_(
        0, example_index, token_losses[valid]
    )
    sizes = torch.zeros(count, device=token_losses.device, dtype=token_losses.dtype).index_add_(
        0, example_index, torch.ones_like(token_losses[valid])
    )
    return sums / sizes


def sft_loss_contribution(
    token_losses: Tensor,
    targets: Tensor,
    document_ids: Tensor,
    *,
    reduction: Literal["token", "example"],
    step_tokens: Tensor,
    step_examples: Tensor,
) -> Tensor:
    """This micro-batch's share of the step loss.

    ``token``: every supervised token of the step weighs the same, so a 1-token answer packed beside a
    200-token answer gets 1/201 of the weight. ``example``: each example's mean token loss weighs the same,
    whatever its length and whatever it was packed with.
    """
    if reduction == "token":
        return token_losses[targets != IGNORE_INDEX].sum() / step_tokens.clamp(min=1)
    return per_example_mean(token_losses, targets, document_ids).sum() / step_examples.clamp(min=1)


class SFTModule(LanguageModelModule):
    step_metrics = ("loss",)
    # token-loss sum and count overall, short, long; then example-mean sum and example count
    validation_sums = (
        "loss",
        "tokens",
        *(f"{total}_{kind}" for kind in KINDS for total in ("loss", "tokens")),
        "example_loss",
        "examples",
    )
    progress_bar = ("loss", "accuracy")  # the two headline numbers

    def __init__(self, config: SFTConfig, model: Transformer, tokenizer: Any) -> None:
        super().__init__(config)
        self.save_hyperparameters({"config": to_dict(config), "model": model.config.to_dict()})
        self.model = model
        self.tokenizer = tokenizer

    def _token_losses(self, batch: dict[str, Tensor]) -> Tensor:
        return self.model.token_losses(
            batch["input_ids"],
            batch["targets"],
            document_ids=batch["document_ids"],
            z_loss=self.config.optim.z_loss,
            chunk_size=self.config.trainer.loss_chunk_size,
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        share = sft_loss_contribution(
            self._token_losses(batch),
            batch["targets"],
            batch["document_ids"],
            reduction=self.config.loss.reduction,
            step_tokens=batch["step_tokens"],
            step_examples=batch["step_examples"],
        )
        return self.loss_to_backpropagate(share)

    # ---- validation: loss by answer length, then greedy answers ----

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        losses = self._token_losses(batch)
        supervised = batch["targets"] != IGNORE_INDEX
        totals = [losses.sum(), supervised.sum()]
        for kind_id in range(len(KINDS)):
            in_kind = supervised & (batch["example_kinds"] == kind_id)
            totals += [losses[in_kind].sum(), in_kind.sum()]
        example_means = per_example_mean(losses, batch["targets"], batch["document_ids"])
        totals += [example_means.sum(), torch.tensor(example_means.numel(), device=self.device)]
        self.add_validation_sums(torch.stack([t.float() for t in totals]))

    def validation_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        metrics = {
            "loss": totals["loss"] / max(totals["tokens"], 1),
            "example_loss": totals["example_loss"] / max(totals["examples"], 1),
        }
        for kind in KINDS:
            if totals[f"tokens_{kind}"]:
                metrics[f"loss_{kind}"] = totals[f"loss_{kind}"] / totals[f"tokens_{kind}"]
        return {**metrics, **self._generation_metrics()}

    def _generation_metrics(self) -> dict[str, float]:
        """Exact match of greedy answers on validation examples with a reference, each rank its share; keyed by
        the names logged under ``val/``."""
        budget = self.config.eval.generations
        examples = self.trainer.datamodule.val_examples[:budget]
        mine = examples[self.global_rank :: self.trainer.world_size]
        answers = [""] * len(mine)
        cut = 0
        # Every rank gathers FSDP weights exactly once here, whatever its number of batches (none, even): a
        # gather per batch would leave a rank with fewer batches out of a collective, and the others waiting.
        with unsharded_for_generation(self.model):
            for batch in plan_generations(mine, self.tokenizer, self.config, self.model.config.max_seq_len):
                cut += batch.cut
                replies = answer_prompts(
                    self.model,
                    self.tokenizer,
                    [mine[i]["prompt_ids"] for i in batch.indices],
                    max_new_tokens=batch.budgets,
                    batch_size=len(batch.indices),  # one generate call: its budgets were fitted to its longest prompt
                )
                for index, reply in zip(batch.indices, replies):
                    answers[index] = reply
        # [correct, total] for short then long examples, then the cut references: one all-reduce
        counts = torch.zeros(2 * len(KINDS) + 1, device=self.device)
        for example, answer in zip(mine, answers):
            index = 2 * KINDS.index(example["kind"])
            counts[index] += float(exact_match(answer, example["reference"]))
            counts[index + 1] += 1
        counts[-1] = cut
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        counts, cut = counts[:-1], counts[-1]
        self._write_samples(mine, answers)
        metrics = {"cut_references": cut}
        if sum(counts[1::2]):
            metrics["accuracy"] = sum(counts[0::2]) / sum(counts[1::2])
        for index, kind in enumerate(KINDS):
            if counts[2 * index + 1]:
                metrics[f"accuracy_{kind}"] = counts[2 * index] / counts[2 * index + 1]
        return metrics

    def _write_samples(self, examples: list[dict], answers: list[str]) -> None:
        """Rank 0's answers: a W&B table when W&B is on, and val_samples.jsonl beside the run always."""
        if not self.trainer.is_global_zero or not examples:
            return
        rows = [
            [
                self.global_step,
                self.tokenizer.decode(e["prompt_ids"]),
                e["reference"],
                a,
                exact_match(a, e["reference"]),
            ]
            for e, a in zip(examples, answers)
        ][: self.config.eval.table_rows]
        columns = ["step", "prompt", "reference", "answer", "correct"]
        if hasattr(self.logger, "log_table"):
            self.logger.log_table(key="val/samples", columns=columns, data=rows)
        path = Path(self.trainer.default_root_dir) / "val_samples.jsonl"
        with open(path, "a") as handle:
            for row in rows:
                handle.write(json.dumps(dict(zip(columns, row))) + "\n")


@dataclass
class GenerationBatch:
    indices: list[int]  # into the examples planned
    budgets: list[int]  # max_new_tokens of each
    cut: int  # examples whose reference is longer than their budget: exact match is impossible for them


def plan_generations(
    examples: list[dict], tokenizer: Any, config: SFTConfig, max_seq_len: int
) -> list[GenerationBatch]:
    """Validation generations in batches of eval.batch_size by prompt length, each budget the reference's
    length plus eval.max_new_tokens_margin, cut to what the context leaves after the batch's longest prompt.
    A reference that no longer fits is counted as cut (and can only score 0); a prompt that leaves no room
    at all is a ConfigError naming the example."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["prompt_ids"]))
    batches = []
    for start in range(0, len(order), config.eval.batch_size):
        indices = order[start : start + config.eval.batch_size]
        longest = max(len(examples[i]["prompt_ids"]) for i in indices)
        if longest >= max_seq_len:
            example = max((examples[i] for i in indices), key=lambda e: len(e["prompt_ids"]))
            raise ConfigError(
                f"SFT validation prompt {example.get('where', '?')} has {longest} tokens: no room to generate within "
                f"the model's max_seq_len {max_seq_len}; lower data.seq_len or set eval.generations=0"
            )
        room = max_seq_len - longest
        references = [len(tokenizer.encode(examples[i]["reference"])) for i in indices]
        budgets = [min(n + config.eval.max_new_tokens_margin, room) for n in references]
        batches.append(GenerationBatch(indices, budgets, sum(n > room for n in references)))
    return batches


def check_generation_budgets(config: SFTConfig, examples: list[dict], tokenizer: Any, max_seq_len: int) -> int:
    """Before training: every validation generation fits the context (else the first validation would crash and
    the training so far be lost). Returns how many references are cut, and warns when any are."""
    if config.eval.generations == 0 or not examples:
        return 0
    cut = sum(b.cut for b in plan_generations(examples[: config.eval.generations], tokenizer, config, max_seq_len))
    if cut:
        log.warning(
            "%d of the first %d validation references are longer than the context leaves after their prompts "
            "(max_seq_len %d): they are cut and count as wrong (val/cut_references)",
            cut,
            min(len(examples), config.eval.generations),
            max_seq_len,
        )
    return cut


def run_sft(config: SFTConfig, extra_callbacks: list[L.Callback] | None = None, *, stage: Stage = SFT) -> Path | None:
    """Check everything that can be checked, then fine-tune; returns the run folder on rank 0, else None. ``stage``:
    its record (an SFT variant's own), whose model roles are checked and whose name the run folder records."""
    check_stage_config(config, stage.model_folders(config))  # before anything is created
    plan = stage.preflight(config)  # before any weights load
    return fine_tune(config, extra_callbacks, stage=stage, plan=plan)


def fine_tune(
    config: SFTConfig, extra_callbacks: list[L.Callback] | None = None, *, stage: Stage = SFT,
    plan: PlannedRun | None = None,
) -> Path | None:  # fmt: skip
    """``run_sft`` after its stage check and pre-flight ``plan``, for a stage that made them on the config it derived
    this one from (rejection sampling, which fine-tunes in its own folder)."""
    tokenizer = Tokenizer.load(config.data.tokenizer)
    datamodule = SFTDataModule(
        config.data,
        micro_batch_size=config.loader.micro_batch_size,
        accumulate_grad_batches=config.trainer.accumulate_grad_batches,
        num_workers=config.loader.num_workers,
    )
    # loading, encoding and packing errors surface before any weights are read or any process is launched
    datamodule.setup("fit")
    model = load_initial_model(config)
    check_initial_model(config, tokenizer, model.config)
    SFT.check_row_tokens(config, model.config.max_seq_len, "the model's max_seq_len")  # an SFT config's rows
    adapter_bases = add_stage_adapters(config, model)  # peft.kind=lora: only the adapters train
    check_generation_budgets(config, datamodule.val_examples, tokenizer, model.config.max_seq_len)

    run_dir = start_run_directory(config, stage.name, data_stats=datamodule.stats)
    callbacks = [
        *stage_callbacks(
            config,
            run_dir,
            tokenizer,
            metadata={"stage": "sft", "tokenizer": str(tokenizer.path)},
            throughput=(
                config.loader.micro_batch_size * config.data.seq_len,
                model.config.flops_per_token(config.data.seq_len),
            ),
        ),
        LossPlot(
            run_dir,
            metrics=("train/loss", "val/loss", "val/loss_short", "val/loss_long"),
            title=f"SFT: {config.run.name}",
        ),
        LossPlot(
            run_dir,
            metrics=("val/accuracy", "val/accuracy_short", "val/accuracy_long"),
            title=f"SFT exact-match accuracy: {config.run.name}",
            filename="accuracy.png",
            ylabel="exact-match accuracy",
        ),
        *(extra_callbacks or []),
    ]
    module = SFTModule(config, model, tokenizer)
    module.adapter_bases = adapter_bases
    return fit_stage(config, module, datamodule, run_dir, callbacks, plan=plan)
