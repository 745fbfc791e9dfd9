"""The DPO stage's recipe (``run_dpo``): check the config, load the policy (and the frozen reference, or with
LoRA the policy with its adapters off), build the preference pairs, fit ``DPOModule`` and export the policy."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import lightning as L
from torch import Tensor, nn

from alignment.schemas.dpo import DPOConfig
from alignment.shared.initial_model import add_stage_adapters, load_initial_model
from alignment.stages.dpo_module import DPOModule, reference_dtype
from alignment.stages.registry import stage_named
from alignment.stages.reward import preference_data, preference_stage_callbacks
from data.preference.dpo import DPODataModule
from data.tokenizer.tokenizer import Tokenizer
from models.adapter_config import adapter_config
from models.errors import ConfigError
from models.files.digests import content_key, state_dict_digest
from models.model import Transformer
from trainer.build import check_stage_config, fit_stage, start_run_directory
from trainer.callbacks import LossPlot

log = logging.getLogger(__name__)

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


def _check_model(config: DPOConfig, model: Transformer, key: str) -> None:
    path = getattr(config.init, key)
    source = path or "the model (model.vocab_size)"  # its tokenizer was checked by check_stage_config
    stage_named("dpo").check_row_tokens(config, model.config.max_seq_len, f"{source}'s max_seq_len")


def load_dpo_models(
    config: DPOConfig, tokenizer: Tokenizer
) -> tuple[Transformer, Transformer | None, dict[str, dict[str, Any]]]:
    """(policy, frozen reference or None, the policy's adapter bases for ``DPOModule.adapter_bases``), checked
    against the tokenizer and data.seq_len. The reference is ``init.reference``, else a deep copy of the policy as
    loaded (no tensor shared with the trained copy); None for simpo, and with ``peft.kind: lora`` and no
    ``init.reference``: the policy (given its adapters here) is then its own reference with the adapters off."""
    policy = load_initial_model(config, "policy")
    _check_model(config, policy, "policy")
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
    _check_model(config, reference, "reference")
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


def run_dpo(config: DPOConfig, extra_callbacks: list[L.Callback] | None = None) -> Path | None:
    """Check everything that can be checked, then train the policy; returns the run folder on rank 0."""
    check_stage_config(config, stage_named("dpo").model_folders(config))
    check_dpo_config(config)
    plan = stage_named("dpo").preflight(config)  # before any weights load
    tokenizer = Tokenizer.load(config.data.tokenizer)
    datamodule = preference_data(config, DPODataModule)  # bad data in one line before any weights are read
    policy, reference, adapter_bases = load_dpo_models(config, tokenizer)
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
