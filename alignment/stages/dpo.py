"""DPO, one file: ``DPOModule`` (direct preference optimisation of a policy against a frozen reference, DPO or IPO,
or none, SimPO; chosen and rejected rows scored in one forward through the fused per-token loss; the reference's
log-probs precomputed once, cached in the run folder, or scored beside each micro-batch), then ``run_dpo``: check the
config, load the policy (and the frozen reference, or with LoRA the policy with its adapters off), build the
preference pairs, fit the module and export the policy.

    lantern dpo configs/dpo/tiny.yaml loss.kind=ipo
"""

from __future__ import annotations

import copy
import io
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from alignment.schemas.dpo import DPOConfig
from alignment.shared.initial_model import add_stage_adapters, load_initial_model
from alignment.shared.losses import preference_loss
from alignment.stages.registry import DPO, Stage
from alignment.stages.reward import preference_data, preference_stage_callbacks
from data.preference.dpo import DPODataModule
from data.tokenizer.tokenizer import Tokenizer
from models.adapters import adapters_disabled
from models.errors import ConfigError
from models.files.atomic import write_atomically
from models.files.digests import content_key, state_dict_digest
from models.loss import IGNORE_INDEX
from models.model import Transformer
from models.model_config import adapter_config
from trainer.build import check_stage_config, fit_stage, start_run_directory
from trainer.callbacks import LossPlot
from trainer.config import TrainerConfig, to_dict
from trainer.lm_module import LanguageModelModule

log = logging.getLogger(__name__)

METRICS = ("loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")


def response_logprob_sums(
    model: Transformer, batch: dict[str, Tensor], chunk_size: int | None
) -> tuple[Tensor, Tensor]:
    """(summed log-probs of each row's response tokens, their count), (2B,) each, in one forward over every row.

    ``batch["targets"]`` holds the next token where it is a response token and IGNORE_INDEX elsewhere, so the
    model's per-token loss is -log p of exactly those tokens and 0 elsewhere. Rows are right-padded, so plain
    causal attention already keeps every real token from the padding after it: no document mask is passed, which
    keeps SDPA's causal fast path."""
    losses = model.token_losses(batch["input_ids"], batch["targets"], chunk_size=chunk_size)
    return -losses.sum(-1), (batch["targets"] != IGNORE_INDEX).sum(-1)


def reference_dtype(config: TrainerConfig) -> torch.dtype:
    """The reference's parameter dtype: bf16 where the policy computes with bf16 parameters (bf16-true, or FSDP2's
    bf16 mixed precision, under which Lightning adds no autocast), else fp32 (autocast covers bf16-mixed)."""
    bf16 = config.precision == "bf16-true" or (config.strategy == "fsdp" and config.precision == "bf16-mixed")
    return torch.bfloat16 if bf16 else torch.float32


class DPOModule(LanguageModelModule):
    step_metrics = METRICS  # the step's means over all its pairs
    validation_sums = (*METRICS, "pairs")  # pair_terms' sums
    progress_bar = ("loss", "reward_accuracy")

    def __init__(
        self,
        config: DPOConfig,
        policy: Transformer,
        reference: Transformer | None,
        tokenizer: Any,
        *,
        cache_key: str | None = None,
    ) -> None:
        super().__init__(config)
        self.save_hyperparameters({"config": to_dict(config), "model": policy.config.to_dict()})
        self.model, self.tokenizer = policy, tokenizer
        self.uses_reference = config.loss.kind != "simpo"
        # no frozen reference for a policy with adapters: the reference is the policy with its adapters off
        self.reference_is_base = self.uses_reference and reference is None and adapter_config(policy) is not None
        if self.uses_reference and reference is None and not self.reference_is_base:
            raise ValueError(f"loss.kind {config.loss.kind} needs a reference model (or a policy with adapters)")
        # out of the module tree: not in state_dict, not sharded, not moved by Lightning (see on_fit_start)
        frozen = self.uses_reference and reference is not None
        self.frozen = {"reference": reference.eval().requires_grad_(False)} if frozen else {}
        self.precompute = self.uses_reference and config.loss.reference_logprobs == "precompute"
        self.cache_key = cache_key  # names the on-disk table; None keeps it in memory only
        self.reference_table: dict[str, Tensor] = {}  # split -> (pairs, 2) summed log-probs [chosen, rejected]

    # ---- log-probs ----

    def _reference_sums(self, batch: dict[str, Tensor], split: str) -> Tensor:
        """The reference's summed response log-probs of the batch's 2B rows, from the table or a forward."""
        if self.precompute:
            table = self.reference_table[split][batch["pair_index"].clamp(min=0)]  # empty slots read pair 0
            return torch.cat([table[:, 0], table[:, 1]])
        return self._reference_forward(batch)

    def _reference_forward(self, batch: dict[str, Tensor]) -> Tensor:
        """The reference's summed response log-probs: the frozen reference's, computed where it lives, or the
        policy's with its adapters off; on the policy's device in fp32."""
        if self.reference_is_base:
            with adapters_disabled(self.model), torch.no_grad():
                sums, _ = response_logprob_sums(self.model, batch, self.config.trainer.loss_chunk_size)
            return sums.float()
        reference = self.frozen["reference"]
        device = next(reference.parameters()).device
        with torch.no_grad():
            sums, _ = response_logprob_sums(
                reference, {key: value.to(device) for key, value in batch.items()}, self.config.trainer.loss_chunk_size
            )
        return sums.to(device=self.device, dtype=torch.float32)

    def pair_terms(self, batch: dict[str, Tensor], split: str) -> tuple[Tensor, Tensor]:
        """(loss sum over the real pairs, with grad; detached [loss sum, correct, margin sum, chosen reward sum,
        rejected reward sum, pairs])."""
        loss_config = self.config.loss
        policy, counts = response_logprob_sums(self.model, batch, self.config.trainer.loss_chunk_size)
        reference = self._reference_sums(batch, split) if self.uses_reference else None
        if loss_config.kind != "dpo":  # ipo, simpo: mean log-prob per response token
            scale = counts.clamp(min=1).to(policy.dtype)
            policy = policy / scale
            reference = None if reference is None else reference / scale
        policy_chosen, policy_rejected = policy.chunk(2)
        reference_chosen, reference_rejected = (None, None) if reference is None else reference.chunk(2)
        losses, chosen, rejected = preference_loss(
            policy_chosen,
            policy_rejected,
            reference_chosen,
            reference_rejected,
            kind=loss_config.kind,
            beta=loss_config.beta,
            label_smoothing=loss_config.label_smoothing,
            simpo_gamma=loss_config.simpo_gamma,
        )
        real = batch["pair_mask"]
        zero = torch.zeros_like(losses)
        loss = torch.where(real, losses, zero).sum()
        margin = torch.where(real, chosen - rejected, zero)
        # a tie is not a win: with the policy equal to the reference every margin is 0 and accuracy 0 (as TRL)
        sums = torch.stack(
            [
                loss.detach(),
                (margin > 0).float().sum(),
                margin.sum(),
                torch.where(real, chosen, zero).sum(),
                torch.where(real, rejected, zero).sum(),
                real.float().sum(),
            ]
        )
        return loss, sums

    # ---- the reference: placed, and with precompute scored once ----

    def on_fit_start(self) -> None:
        if "reference" in self.frozen:
            self.frozen["reference"] = self.frozen["reference"].to(
                device=self.device, dtype=reference_dtype(self.config.trainer)
            )
        if self.precompute:
            self.reference_table = self._reference_tables()
            self.frozen.clear()  # every log-prob it gives is in the table now: its memory goes back to training

    def _cache_path(self) -> Path | None:
        if self.cache_key is None:
            return None
        return Path(self.trainer.default_root_dir) / f"reference-logprobs-{self.cache_key}.pt"

    def _reference_tables(self) -> dict[str, Tensor]:
        """{split: (pairs, 2)} from the run folder's cache when every rank finds it, else from one pass."""
        path = self._cache_path()
        found = torch.tensor(float(path is not None and path.is_file()), device=self.device)
        if self.trainer.world_size > 1:  # all ranks load, or all compute: the pass runs collectives
            found = self.trainer.strategy.reduce(found, reduce_op="min")
        if found.item() >= 1:
            saved = torch.load(path, map_location=self.device, weights_only=True)
            log.info("reference log-probs from %s", path)
            return saved["tables"]
        tables = {}
        for split in ("train", "val"):
            table = self._score_split(split)
            if table is not None:
                tables[split] = table
        if path is not None and self.trainer.is_global_zero:
            buffer = io.BytesIO()
            torch.save({"key": self.cache_key, "tables": {k: v.cpu() for k, v in tables.items()}}, buffer)
            write_atomically(path, buffer.getvalue(), what="reference log-probs")
        return tables

    @torch.no_grad()
    def _score_split(self, split: str) -> Tensor | None:
        """The reference's summed log-probs of every pair of a split, (pairs, 2); each rank scores its share
        (equal numbers of batches on every rank) and the shares are summed over ranks."""
        batches = self.trainer.datamodule.eval_batches(split)
        if batches is None:
            return None
        table = torch.zeros(len(batches.pairs), 2, device=self.device)
        with self.trainer.precision_plugin.forward_context():  # the numerics of the training steps
            for batch in batches:
                batch = {key: value.to(self.device) for key, value in batch.items()}
                chosen, rejected = self._reference_forward(batch).chunk(2)
                real = batch["pair_mask"]
                table[batch["pair_index"][real]] = torch.stack([chosen[real], rejected[real]], dim=1)
        if self.trainer.world_size > 1:
            table = self.trainer.strategy.reduce(table, reduce_op="sum")  # each pair was scored on one rank
        if self.trainer.is_global_zero:
            log.info("reference log-probs of %d %s pairs computed", len(table), split)
        return table

    # ---- training ----

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, sums = self.pair_terms(batch, "train")
        step_pairs = batch["step_pairs"].clamp(min=1)
        return self.loss_to_backpropagate(loss / step_pairs, sums[:5] / step_pairs)

    # ---- validation: the same numbers on held-out pairs ----

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.add_validation_sums(self.pair_terms(batch, "val")[1])

    def export_metadata(self) -> dict[str, Any]:
        loss = self.config.loss
        return {"stage": "dpo", "tokenizer": str(self.tokenizer.path), "loss": loss.kind, "beta": loss.beta}


# bump when what the reference table holds, or how responses are found, changes
CACHE_FORMAT = 1


# ---- checks and models ----


def check_dpo_config(config: DPOConfig) -> None:
    """The DPO rules that span keys, before anything is built (each key's range is check_stage_config's): ipo has
    no label smoothing, and simpo no reference."""
    loss = config.loss
    if loss.label_smoothing and loss.kind == "ipo":
        raise ConfigError("loss.label_smoothing applies to dpo and simpo; ipo has none: set it to 0")
    if loss.kind == "simpo" and config.init.reference:
        log.warning("init.reference is not used: simpo has no reference model")


def _check_model(config: DPOConfig, model: Transformer, key: str, stage: Stage) -> None:
    path = getattr(config.init, key)
    source = path or "the model (model.vocab_size)"  # its tokenizer was checked by check_stage_config
    stage.check_row_tokens(config, model.config.max_seq_len, f"{source}'s max_seq_len")


def load_dpo_models(
    config: DPOConfig, tokenizer: Tokenizer, stage: Stage = DPO
) -> tuple[Transformer, Transformer | None, dict[str, dict[str, Any]]]:
    """(policy, frozen reference or None, the policy's adapter bases for ``DPOModule.adapter_bases``), checked
    against the tokenizer and data.seq_len. The reference is ``init.reference``, else a deep copy of the policy as
    loaded (no tensor shared with the trained copy); None for simpo, and with ``peft.kind: lora`` and no
    ``init.reference``: the policy (given its adapters here) is then its own reference with the adapters off."""
    policy = load_initial_model(config, "policy")
    _check_model(config, policy, "policy", stage)
    if config.init.policy and config.model != policy.config:
        log.info("model section ignored: the policy is %s's (config.yaml records it)", config.init.policy)
    config.model = policy.config  # config.yaml and the checkpoints record the model really trained
    adapter_bases = add_stage_adapters(config, policy, key="policy")  # peft.kind=lora: only the adapters train
    if config.loss.kind == "simpo":
        return policy, None, adapter_bases
    if not config.init.reference:
        # the policy as loaded: with adapters, its base (DPOModule switches them off); else a copy taken before
        # any training (no adapters were added above)
        return policy, None if adapter_bases else copy.deepcopy(policy), adapter_bases
    reference = load_initial_model(config, "reference")
    _check_model(config, reference, "reference", stage)
    if reference.config.vocab_size != policy.config.vocab_size:
        raise ConfigError(
            f"init.reference {config.init.reference} has vocab_size {reference.config.vocab_size}, the policy "
            f"{policy.config.vocab_size}: they must share one tokenizer"
        )
    return policy, reference, adapter_bases


def base_state(model: nn.Module) -> dict[str, Tensor]:
    """A model's weights without its LoRA adapters, under the plain model's names (``...wq.weight``, not peft's
    ``...wq.base_layer.weight``): what the model computes with its adapters off. A model without adapters: all."""
    return {
        name.replace(".base_layer.", "."): tensor for name, tensor in model.state_dict().items() if "lora_" not in name
    }


def reference_cache_key(config: DPOConfig, reference: nn.Module, datamodule: DPODataModule) -> str:
    """What the precomputed reference table depends on: the reference's weights (their
    bytes), the pairs of both splits (their ids), the numerics the reference runs in, and the table's format.
    ``reference`` is the frozen reference, or the policy whose base (adapters off) is the reference: its base's
    weights are hashed, never the adapters (which train, and are zero at the start anyway)."""
    data = datamodule.data
    base = adapter_config(reference) is not None
    return content_key(
        {
            "format": CACHE_FORMAT,
            "reference": state_dict_digest(base_state(reference)),
            # the policy's base runs in the policy's numerics (FSDP2's, or autocast), a frozen copy in its own
            **({"reference_is_policy_base": True} if base else {}),
            "train": data.train.fingerprint(),
            "val": data.val.fingerprint() if data.val is not None else None,
            "precision": config.trainer.precision,
            "dtype": str(reference_dtype(config.trainer)),
            "loss_chunk_size": config.trainer.loss_chunk_size,
        }
    )


# ---- the stage ----


def run_dpo(config: DPOConfig, extra_callbacks: list[L.Callback] | None = None, *, stage: Stage = DPO) -> Path | None:
    """Check everything that can be checked, then train the policy; returns the run folder on rank 0. ``stage``: its
    record (a variant's own)."""
    check_stage_config(config, stage.model_folders(config))
    check_dpo_config(config)
    plan = stage.preflight(config)  # before any weights load
    tokenizer = Tokenizer.load(config.data.tokenizer)
    datamodule = preference_data(config, DPODataModule)  # bad data in one line before any weights are read
    policy, reference, adapter_bases = load_dpo_models(config, tokenizer, stage)
    uses_reference = config.loss.kind != "simpo"
    precompute = uses_reference and config.loss.reference_logprobs == "precompute"
    scored = policy if reference is None else reference  # no frozen reference (peft.kind=lora): the policy's base
    cache_key = reference_cache_key(config, scored, datamodule) if precompute else None

    run_dir = start_run_directory(config, "dpo", data_stats=datamodule.stats)
    name, kind = config.run.name, config.loss.kind.upper()
    callbacks = [
        # throughput counts both sides' real tokens and the policy's FLOPs (an on-the-fly reference adds a third)
        *preference_stage_callbacks(config, run_dir, tokenizer, datamodule, policy.config),
        LossPlot(run_dir, metrics=("train/loss", "val/loss"), title=f"{kind}: {name}"),
        LossPlot(
            run_dir,
            metrics=("train/reward_accuracy", "val/reward_accuracy"),
            title=f"{kind} implicit-reward accuracy (chosen > rejected): {name}",
            filename="accuracy.png",
            ylabel="reward accuracy",
        ),
        LossPlot(
            run_dir,
            metrics=("train/reward_margin", "val/reward_margin", "train/chosen_reward", "train/rejected_reward"),
            title=f"{kind} implicit rewards: {name}",
            filename="rewards.png",
            ylabel="reward",
        ),
        *(extra_callbacks or []),
    ]
    module = DPOModule(config, policy, reference, tokenizer, cache_key=cache_key)
    module.adapter_bases = adapter_bases
    del policy, reference  # the module holds them now; a precomputed reference is freed once it is scored
    return fit_stage(config, module, datamodule, run_dir, callbacks, plan=plan)
