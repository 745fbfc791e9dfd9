"""The schema of `lantern dpo` (alignment/stages/dpo.py): DPOConfig and its init and loss sections.

Owns: the DPO-specific keys and their defaults (``init.policy`` / ``init.reference``, ``loss.*``).
Does not own: the shared sections (trainer/config.py: run, optim, trainer, checkpoint, logger, loader), the
preference data keys (data/preference/config.py, the reward model's, so DPO reads the same formats), or the
checks of the DPO keys' values, which alignment/stages/dpo.py's ``check_dpo_config`` makes with messages that name
the key (trainer/checks.py's RANGES table covers the shared numeric keys when the config is loaded).

Choices (defaults for someone who has run DPO before):
- ``loss.beta`` 0.1 and ``loss.label_smoothing`` 0 are TRL's defaults; ``loss.simpo_gamma`` 0.5 is the SimPO
  margin γ used as is (not a ratio of β). SimPO's paper uses β of 2 to 10: set it when choosing simpo.
- ``loss.reference_logprobs`` precompute: the reference's log-probs of every train and val pair come from one
  pass before training (cached in the run folder under a hash, so a resume reuses exactly the same numbers) and
  the reference is freed after it; on_the_fly runs the reference beside the policy every step.
- The optimiser defaults to a constant learning rate after a short warmup (min_lr == lr makes trainer/optim.py's
  warmup_cosine constant) and no weight decay, as DPO recipes do. The rate is 5e-5, not TRL's 5e-7 / 1e-6: those
  suit billion-parameter models; our presets are 2-25M parameters. Measured on the pretrained tiny preset over
  the demo pairs (60 steps of 8 pairs, held-out margin / loss): 1e-6 0.001 / 0.693 and 1e-5 0.010 / 0.689 barely
  move, 5e-5 0.043 / 0.682 and 1e-4 0.074 / 0.677 learn. Lower it (with optim.min_lr) for large models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from alignment.schemas.common import StageLoaderConfig
from data.preference.config import PreferenceDataConfig
from models.adapter_config import PeftConfig
from models.model import ModelConfig
from trainer.config import CheckpointConfig, LoggerConfig, OptimConfig, RunConfig, TrainerConfig


@dataclass
class DPOInitConfig:
    policy: str | None = None  # the SFT model folder DPO starts from; None: a seeded random `model` (smoke runs)
    reference: str | None = None  # the frozen reference; None: the same weights as init.policy (the usual DPO)


@dataclass
class DPOLossConfig:
    kind: Literal["dpo", "ipo", "simpo"] = "dpo"  # dpo sums response log-probs; ipo and simpo average them
    beta: float = 0.1  # > 0; SimPO's paper uses 2 to 10
    label_smoothing: float = 0.0  # [0, 0.5): conservative DPO (dpo and simpo; ipo has none)
    simpo_gamma: float = 0.5  # >= 0: the target margin of simpo
    reference_logprobs: Literal["precompute", "on_the_fly"] = "precompute"  # unused by simpo (no reference)


@dataclass
class DPOConfig:
    run: RunConfig = field(default_factory=lambda: RunConfig(name="dpo"))
    init: DPOInitConfig = field(default_factory=DPOInitConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # LoRA adapters (kind: lora); default: none
    model: ModelConfig = field(default_factory=ModelConfig)  # only used without init.policy
    data: PreferenceDataConfig = field(default_factory=lambda: PreferenceDataConfig(train=[]))
    loader: StageLoaderConfig = field(default_factory=StageLoaderConfig)
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=5e-5, min_lr=5e-5, warmup_steps=10, weight_decay=0.0)
    )
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=200, val_every_n_steps=50))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
