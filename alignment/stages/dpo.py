"""The DPO stage (`lantern dpo`), as a recipe: check the config, load the policy (and the frozen reference),
build the preference pairs, then fit ``DPOModule`` (alignment/stages/dpo_module.py, which owns the loss, the reference
log-probs and the logging) with the callbacks every stage has, exporting the policy to ``final/`` as SFT does.

Owns also what DPO adds to the reward model's data (data/preference/pairs.py, read as is: the same formats and
filtering): which tokens of a side are the response (``answered_masks``), and batches that carry them as
``targets`` (the next token where it is a response token, IGNORE_INDEX elsewhere) with each slot's
``pair_index`` (the row of the precomputed reference table), in ``DPODataModule``.

The response of a side is what the policy would have written: the content and <|eot_id|> of the reply's
assistant turns, not their headers, nor the prompt (which may itself hold assistant turns). The reply starts at
the last <|start_header_id|> the two sides share: their prompts are identical token for token
(data/preference/pairs.py cuts both alike) and the replies differ, so that is the first reply turn's header, or,
when the replies share whole turns, the header of the turn where they part (shared turns would cancel out of
DPO's difference anyway). Special tokens cannot come from text, so reading them off the ids is exact.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from alignment.schemas.dpo import DPOConfig
from alignment.stages.dpo_module import DPOModule, reference_dtype
from alignment.stages.reward import preference_data, preference_stage_callbacks
from data.preference.datamodule import PreferenceDataModule
from data.preference.pairs import PreferenceEvalBatches, PreferencePairs, PreferenceTrainBatches
from data.tokenizer.tokenizer import Tokenizer
from models.checkpoint import load_checkpoint
from models.errors import ConfigError, DataError
from models.loss import IGNORE_INDEX
from models.model import Transformer
from trainer.build import check_trainer_config, fit_stage, start_run_directory
from trainer.callbacks import LossPlot
from trainer.checks import check_same_tokenizer, check_tokenizer_fits_model

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when what the reference table holds, or how responses are found, changes


# ---- which tokens are the response ----


@dataclass(frozen=True)
class ChatMarkers:
    """The ids that delimit chat turns in ``Tokenizer.encode_chat``'s layout."""

    start_header: int
    end_header: int
    eot: int
    assistant: tuple[int, ...]  # the role's ids between the header tokens
    header_gap: int  # ids of the "\n\n" after <|end_header_id|>

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatMarkers:
        return cls(
            tokenizer.start_header_id,
            tokenizer.end_header_id,
            tokenizer.eot_id,
            tuple(tokenizer.encode("assistant")),
            len(tokenizer.encode("\n\n")),
        )


def _assistant_bodies(side: np.ndarray, start: int, markers: ChatMarkers) -> np.ndarray:
    """True on the content and <|eot_id|> of every assistant turn that begins at or after ``start``."""
    mask = np.zeros(len(side), dtype=bool)
    for header in np.flatnonzero(side[start:] == markers.start_header) + start:
        ends = np.flatnonzero(side[header:] == markers.end_header)
        if not ends.size:
            break
        body = header + int(ends[0]) + 1 + markers.header_gap
        eots = np.flatnonzero(side[body:] == markers.eot)
        stop = body + int(eots[0]) + 1 if eots.size else len(side)
        if tuple(side[header + 1 : header + int(ends[0])].tolist()) == markers.assistant:
            mask[body:stop] = True
    return mask


def answered_masks(chosen: np.ndarray, rejected: np.ndarray, markers: ChatMarkers) -> tuple[np.ndarray, np.ndarray]:
    """The response tokens of both sides of a pair (see the module docstring), as bool masks over their ids."""
    shared = min(len(chosen), len(rejected))
    differ = np.flatnonzero(chosen[:shared] != rejected[:shared])
    shared = int(differ[0]) if differ.size else shared
    headers = np.flatnonzero(chosen[:shared] == markers.start_header)
    reply = int(headers[-1]) if headers.size else 0
    return _assistant_bodies(chosen, reply, markers), _assistant_bodies(rejected, reply, markers)


def attach_answered_masks(pairs: PreferencePairs, markers: ChatMarkers) -> None:
    """Give ``pairs`` a ``response_masks`` attribute (chosen masks, rejected masks); a side without a response
    token is a DataError naming its row."""
    chosen, rejected = [], []
    for index, (c, r) in enumerate(zip(pairs.chosen, pairs.rejected)):
        c_mask, r_mask = answered_masks(c, r, markers)
        if not c_mask.any() or not r_mask.any():
            raise DataError(f"{pairs.where[index]}: a reply has no assistant tokens to score")
        chosen.append(c_mask)
        rejected.append(r_mask)
    pairs.response_masks = (chosen, rejected)


def with_dpo_fields(batch: dict[str, torch.Tensor], pairs: PreferencePairs, indices: Any) -> dict[str, torch.Tensor]:
    """Add ``targets`` (2B, T) and ``pair_index`` (B,) (-1 on empty slots) to a preference batch."""
    indices = [int(i) for i in indices]
    rows, width = batch["input_ids"].shape
    answered = torch.zeros((rows, width), dtype=torch.bool)
    chosen, rejected = pairs.response_masks
    for row, index in enumerate(indices):
        if index >= 0:
            answered[row, : len(chosen[index])] = torch.from_numpy(chosen[index])
            answered[len(indices) + row, : len(rejected[index])] = torch.from_numpy(rejected[index])
    ids = batch["input_ids"]
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, :-1] = torch.where(answered[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE_INDEX))
    return {**batch, "targets": targets, "pair_index": torch.tensor(indices, dtype=torch.long)}


class DPOTrainBatches(PreferenceTrainBatches):
    def __getitem__(self, item: tuple) -> dict[str, torch.Tensor]:
        return with_dpo_fields(super().__getitem__(item), self.pairs, item[0])


class DPOEvalBatches(PreferenceEvalBatches):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return with_dpo_fields(super().__getitem__(index), self.pairs, self.slots(index, self.rank))


class DPODataModule(PreferenceDataModule):
    """The reward model's preference data with the DPO fields in every batch (train, val, the reference pass)."""

    row_batches = DPOTrainBatches
    stage = "DPO"  # its data statistics and skipped-row warnings are DPO's, not the reward model's

    def build_data(self, tokenizer: Tokenizer) -> Any:
        data = super().build_data(tokenizer)
        markers = ChatMarkers.of(tokenizer)
        for pairs in (data.train, data.val):
            if pairs is not None:
                attach_answered_masks(pairs, markers)
        return data

    def eval_batches(self, split: str = "val", limit: int | None = None) -> DPOEvalBatches | None:
        """This rank's share of every pair of a split (``limit`` is not supported: the masks are per split)."""
        if limit is not None:
            raise ValueError("DPODataModule.eval_batches scores whole splits")
        data = self._require_data()
        pairs = data.val if split == "val" else data.train
        if pairs is None or len(pairs) == 0:
            return None
        return DPOEvalBatches(pairs, self.val_micro_batch_size, rank=self.rank, world_size=self.world_size)


# ---- checks and models ----


def check_dpo_config(config: DPOConfig) -> None:
    """The DPO keys' values, before anything is built: here so that they hold whatever trainer/checks.py's RANGES
    table (which checks numeric keys when a config is loaded) says about them; ipo has no label smoothing."""
    loss = config.loss
    if not (math.isfinite(loss.beta) and loss.beta > 0):
        raise ConfigError(f"loss.beta must be > 0, got {loss.beta}")
    if not 0.0 <= loss.label_smoothing < 0.5:
        raise ConfigError(f"loss.label_smoothing must be in [0, 0.5), got {loss.label_smoothing}")
    if loss.label_smoothing and loss.kind == "ipo":
        raise ConfigError("loss.label_smoothing applies to dpo and simpo; ipo has none: set it to 0")
    if not (math.isfinite(loss.simpo_gamma) and loss.simpo_gamma >= 0):
        raise ConfigError(f"loss.simpo_gamma must be >= 0, got {loss.simpo_gamma}")
    if loss.kind == "simpo" and config.init.reference:
        log.warning("init.reference is not used: simpo has no reference model")


def _load(path: str | None, config: DPOConfig) -> Transformer:
    if path:
        return load_checkpoint(path, dtype=torch.float32)
    torch.manual_seed(config.run.seed)
    return Transformer(config.model)


def _check_model(config: DPOConfig, tokenizer: Tokenizer, model: Transformer, key: str) -> None:
    path = getattr(config.init, key)
    source = path or "the model (model.vocab_size)"
    check_tokenizer_fits_model(tokenizer, model.config, model_name=source)
    if path:
        check_same_tokenizer(
            tokenizer,
            path,
            key="data.tokenizer" if key == "policy" else "data.tokenizer (init.reference's)",
        )
    if config.data.seq_len > model.config.max_seq_len:
        raise ConfigError(
            f"data.seq_len ({config.data.seq_len}) exceeds {source}'s max_seq_len ({model.config.max_seq_len})"
        )


def load_dpo_models(config: DPOConfig, tokenizer: Tokenizer) -> tuple[Transformer, Transformer | None]:
    """(policy, frozen reference or None for simpo), checked against the tokenizer and data.seq_len. The reference
    is ``init.reference``, else a deep copy of the policy as loaded (no tensor shared with the trained copy)."""
    policy = _load(config.init.policy, config)
    _check_model(config, tokenizer, policy, "policy")
    if config.init.policy and config.model != policy.config:
        log.info("model section ignored: the policy is %s's (config.yaml records it)", config.init.policy)
    config.model = policy.config  # config.yaml and the checkpoints record the model really trained
    if config.loss.kind == "simpo":
        return policy, None
    if not config.init.reference:
        return policy, copy.deepcopy(policy)
    reference = _load(config.init.reference, config)
    _check_model(config, tokenizer, reference, "reference")
    if reference.config.vocab_size != policy.config.vocab_size:
        raise ConfigError(
            f"init.reference {config.init.reference} has vocab_size {reference.config.vocab_size}, the policy "
            f"{policy.config.vocab_size}: they must share one tokenizer"
        )
    return policy, reference


def reference_cache_key(config: DPOConfig, reference: Transformer, datamodule: DPODataModule) -> str:
    """What the precomputed reference table depends on, hashed: the reference's weights (their bytes), the
    pairs of both splits (their ids), the numerics the reference runs in, and the table's format."""
    weights = hashlib.sha256()
    for name, tensor in sorted(reference.state_dict().items()):
        weights.update(name.encode())
        weights.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())  # its buffer: no copy
    data = datamodule.data
    what = {
        "format": CACHE_FORMAT,
        "reference": weights.hexdigest(),
        "train": data.train.fingerprint(),
        "val": data.val.fingerprint() if data.val is not None else None,
        "precision": config.trainer.precision,
        "dtype": str(reference_dtype(config.trainer)),
        "loss_chunk_size": config.trainer.loss_chunk_size,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


# ---- the stage ----


def run_dpo(config: DPOConfig, extra_callbacks: list[L.Callback] | None = None) -> Path | None:
    """Check everything that can be checked, then train the policy; returns the run folder on rank 0."""
    check_trainer_config(config.trainer)
    check_dpo_config(config)
    tokenizer = Tokenizer.load(config.data.tokenizer)
    policy, reference = load_dpo_models(config, tokenizer)
    datamodule = preference_data(config, DPODataModule)
    precompute = reference is not None and config.loss.reference_logprobs == "precompute"
    cache_key = reference_cache_key(config, reference, datamodule) if precompute else None

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
    del policy, reference  # the module holds them now; a precomputed reference is freed once it is scored
    return fit_stage(config, module, datamodule, run_dir, callbacks)
