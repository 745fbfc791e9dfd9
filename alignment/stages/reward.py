"""The reward model (``RewardModule``, ``run_rm``): a scalar head on the SFT model trained with the Bradley-Terry loss
on preference pairs, read at each side's last real token; the exported metadata holds the reward's training mean and
std, and ``policy_samples`` trains on (and measures agreement with a checker on) the policy's own samples."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from alignment.schemas.reward import RMConfig
from alignment.shared.initial_model import add_stage_adapters, load_initial_model
from alignment.shared.policy_pairs import measure_agreement, write_policy_pairs
from alignment.stages.registry import RM, Stage
from data.preference.datamodule import PreferenceDataModule
from data.tokenizer.tokenizer import Tokenizer
from models.heads import ScalarModel
from trainer.build import check_stage_config, fit_stage, run_directory, stage_callbacks, start_run_directory
from trainer.callbacks import LossPlot
from trainer.checks import check_initial_model
from trainer.config import to_dict
from trainer.lm_module import LanguageModelModule
from trainer.storage import claim_run_directory

log = logging.getLogger(__name__)


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: float = 0.0) -> Tensor:
    """Per-pair -log sigmoid(r_chosen - r_rejected - margin): the chosen side must win by at least `margin`.
    logsigmoid rather than log(sigmoid(.)): exact for large differences, where sigmoid rounds to 0 or 1."""
    return -F.logsigmoid(chosen - rejected - margin)


def reward_moments(rewards: Tensor) -> Tensor:
    """[count, sum, sum of squares] in float64: sums that add up over batches and ranks."""
    rewards = rewards.detach().double()
    count = torch.tensor(float(rewards.numel()), dtype=torch.float64, device=rewards.device)
    return torch.stack([count, rewards.sum(), rewards.square().sum()])


def normalization_from_moments(moments: Tensor) -> dict[str, float]:
    """{"reward_mean", "reward_std"} (population std) from summed reward_moments."""
    count, total, squares = moments.tolist()
    if count < 1:
        raise ValueError("no rewards to compute the normalisation from")
    mean = total / count
    return {"reward_mean": mean, "reward_std": max(squares / count - mean * mean, 0.0) ** 0.5}


class RewardModule(LanguageModelModule):
    step_metrics = ("loss", "accuracy", "margin")  # the step's means over all its pairs
    validation_sums = ("loss", "accuracy", "margin", "pairs")  # loss sum, correct, margin sum, pairs
    progress_bar = ("loss", "accuracy")

    def __init__(self, config: RMConfig, model: ScalarModel, tokenizer: Any) -> None:
        super().__init__(config)
        self.save_hyperparameters({"config": to_dict(config), "model": model.config.to_dict()})
        self.model = model
        self.tokenizer = tokenizer
        self.normalization: dict[str, float] | None = None

    def rewards(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(chosen, rejected) rewards, (B,) each, read at each side's last real token."""
        scores = self.model(batch["input_ids"], document_ids=batch["document_ids"])
        read = scores.gather(1, batch["score_index"].unsqueeze(1)).squeeze(1).float()
        return read.chunk(2)  # rows are [chosen_0 .. chosen_{B-1}, rejected_0 .. rejected_{B-1}]

    def _pair_sums(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(loss sum with grad, detached [loss sum, correct, margin sum, pairs]) over the real pairs."""
        chosen, rejected = self.rewards(batch)
        real = batch["pair_mask"].float()
        loss = (bradley_terry_loss(chosen, rejected, self.config.loss.margin) * real).sum()
        difference = (chosen - rejected).detach()
        # a tie is not a correct ranking: a reward model that scores everything alike gets accuracy 0, not 1
        correct = ((difference > 0).float() * real).sum()
        sums = torch.stack([loss.detach(), correct, (difference * real).sum(), real.sum()])
        return loss, sums

    # ---- training ----

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, sums = self._pair_sums(batch)
        step_pairs = batch["step_pairs"].clamp(min=1)
        return self.loss_to_backpropagate(loss / step_pairs, sums[:3] / step_pairs)

    # ---- validation: pairwise accuracy on held-out pairs ----

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.add_validation_sums(self._pair_sums(batch)[1])

    # ---- reward normalisation, for the exported metadata ----

    @torch.no_grad()
    def reward_normalization(self) -> dict[str, float]:
        """Mean and std of the reward over both sides of the first ``loss.normalization_pairs`` train pairs, all
        ranks together. A collective: call on every rank (each runs the same number of forwards, as FSDP needs)."""
        batches = self.trainer.datamodule.eval_batches("train", limit=self.config.loss.normalization_pairs)
        moments = torch.zeros(3, dtype=torch.float64, device=self.device)
        training = self.model.training
        self.model.eval()
        with self.trainer.precision_plugin.forward_context():  # the numerics training ran with (e.g. bf16 autocast)
            for batch in batches:
                batch = {key: value.to(self.device) for key, value in batch.items()}
                chosen, rejected = self.rewards(batch)
                real = batch["pair_mask"]
                moments += reward_moments(torch.cat([chosen[real], rejected[real]]))
        self.model.train(training)
        moments = self.trainer.strategy.reduce(moments, reduce_op="sum")
        self.normalization = normalization_from_moments(moments)
        if self.trainer.is_global_zero:
            log.info("reward normalisation over %d train rewards: %s", int(moments[0].item()), self.normalization)
        return self.normalization

    def export_metadata(self) -> dict[str, Any]:
        """ExportFinal's metadata, called on every rank at the end of training."""
        metadata: dict[str, Any] = {
            "stage": "rm",
            "tokenizer": str(self.tokenizer.path),
            "margin": self.config.loss.margin,
        }
        if self.config.loss.normalize_rewards:
            metadata.update(self.reward_normalization())
        return metadata


def load_initial_reward_model(config: RMConfig) -> ScalarModel:
    """The SFT model of ``init.checkpoint`` (or a seeded ``model``) with a freshly initialised scalar head."""
    backbone = load_initial_model(config)
    torch.manual_seed(config.run.seed)  # the same head on every rank and every run
    return ScalarModel.from_backbone(backbone, init="normal").freeze_lm_head()


def preference_data(config: Any, datamodule_class: type = PreferenceDataModule) -> PreferenceDataModule:
    """The stage's preference datamodule (the reward model's, or DPO's subclass), set up before any process is
    launched so loading and encoding errors surface first, and checked to fill one optimizer step on every rank."""
    datamodule = datamodule_class(
        config.data,
        micro_batch_size=config.loader.micro_batch_size,
        accumulate_grad_batches=config.trainer.accumulate_grad_batches,
        num_workers=config.loader.num_workers,
    )
    datamodule.setup("fit")
    datamodule.check_step_fits(config.trainer.devices * config.trainer.num_nodes)
    return datamodule


def preference_stage_callbacks(config: Any, run_dir: Path, tokenizer: Any, datamodule: Any, model_config: Any) -> list:
    """``stage_callbacks`` for a stage that trains on pairs: real tokens of both sides of every pair (not padding)
    and FLOPs per token at the average side length; the export metadata comes from the module at the end."""
    mean_side = round(datamodule.stats["train"]["mean_side_tokens"])
    return stage_callbacks(
        config,
        run_dir,
        tokenizer,
        metadata=lambda module: module.export_metadata(),
        throughput=(datamodule.tokens_per_micro_batch, model_config.flops_per_token(max(mean_side, 1))),
    )


def run_rm(config: RMConfig, extra_callbacks: list[L.Callback] | None = None, *, stage: Stage = RM) -> Path | None:
    """Check everything that can be checked, then train the reward model; returns the run folder on rank 0."""
    check_stage_config(config, stage.model_folders(config))
    plan = stage.preflight(config)  # before any weights load
    tokenizer = Tokenizer.load(config.data.tokenizer)
    samples = config.policy_samples
    sampling = bool(samples.policy and samples.checker and samples.train != "none")
    # bad data in one line before any weights are read (pairs sampled from a policy join the data after it loads)
    datamodule = None if sampling else preference_data(config)
    model = load_initial_reward_model(config)
    check_initial_model(config, tokenizer, model.config)
    stage.check_row_tokens(config, model.config.max_seq_len, "the model's max_seq_len")
    # peft.kind=lora: the backbone's adapters and the whole score head train
    adapter_bases = add_stage_adapters(config, model, base=model.backbone, trainable=("head.",))
    if sampling:
        # every process of a launch samples the same pairs (seeded) and writes the same file atomically
        folder = run_directory(config.run.out_dir, config.run.name)
        claim_run_directory(folder, "rm")  # before the pairs are written into it
        pairs = str(write_policy_pairs(config, folder, tokenizer))
        config.data.train = [pairs] if samples.train == "replace" else [*config.data.train, pairs]
        datamodule = preference_data(config)
    run_dir = start_run_directory(config, "rm", data_stats=datamodule.stats)
    callbacks = [
        # the metadata is called at the end, on every rank: the normalisation pass runs forwards on all of them
        *preference_stage_callbacks(config, run_dir, tokenizer, datamodule, model.config),
        LossPlot(run_dir, metrics=("train/loss", "val/loss"), title=f"Reward model: {config.run.name}"),
        LossPlot(
            run_dir,
            metrics=("train/accuracy", "val/accuracy"),
            title=f"Reward model pairwise accuracy: {config.run.name}",
            filename="accuracy.png",
            ylabel="pairwise accuracy",
        ),
        *(extra_callbacks or []),
    ]
    module = RewardModule(config, model, tokenizer)
    module.adapter_bases = adapter_bases
    run_dir = fit_stage(config, module, datamodule, run_dir, callbacks, plan=plan)
    if run_dir is not None and samples.policy and samples.checker and samples.heldout:  # rank 0, after the export
        result = measure_agreement(config, run_dir, tokenizer)
        log.info("reward model vs %s on the policy's own samples: %.3f agreement over %d pairs",
                 samples.checker, result["agreement"], result["pairs"])  # fmt: skip
    return run_dir
