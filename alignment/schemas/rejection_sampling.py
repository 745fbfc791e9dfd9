"""Config schema of rejection sampling (``lantern rejection-sampling``): K samples per training prompt scored by
the reward, the best kept, then SFT on them (``alignment/stages/rejection_sampling.py``).

Choices: the reward is the one section every sampling stage shares (``RewardConfig``, default: the demo's
checker, as GRPO's); the fine-tuning is the whole SFT schema embedded as the ``sft`` section, so every SFT key
works under ``sft.`` (``sft.optim.lr``, ``sft.trainer.strategy``, ``sft.data.val`` ...), except what the stage
sets itself: ``sft.init.checkpoint`` (= ``init.policy``), ``sft.data.train`` (the kept samples),
``sft.data.tokenizer`` (= ``data.tokenizer``) and ``sft.run`` (= ``run``). There is no separate trainer for
sampling: it runs on the device ``sft.trainer`` names (a GPU unless ``sft.trainer.accelerator=cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alignment.schemas.rl import RewardConfig, RewardTermConfig
from alignment.schemas.sft import SFTConfig
from data.records.prompts import PromptDataConfig
from trainer.config import RunConfig


@dataclass
class RejectionSamplingInitConfig:
    policy: str | None = None  # the SFT model folder: sampled from, and the start of the fine-tuning


@dataclass
class SamplingConfig:
    samples_per_prompt: int = 8  # K responses sampled per training prompt
    keep_per_prompt: int = 1  # the best this many distinct responses of each prompt become SFT examples
    min_score: float | None = None  # keep a response only if its reward is >= this (e.g. 1.0: only correct ones)
    keep_truncated: bool = False  # keep responses cut at response_max_tokens (no end of turn) too
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    response_max_tokens: int = 128
    batch_size: int = 8  # prompts per generation call (each sampled K times: batch_size * K rows)
    prompts: int = 0  # training prompts sampled: 0 = all of them, else a subset seeded by run.seed


def rejection_sampling_sft() -> SFTConfig:
    """The SFT section's defaults: SFT's, with ``run`` left to the stage (an ``sft.run`` key is refused)."""
    config = SFTConfig()
    config.run = RunConfig()
    return config


@dataclass
class RejectionSamplingConfig:
    run: RunConfig = field(default_factory=lambda: RunConfig(name="rejection-sampling"))
    init: RejectionSamplingInitConfig = field(default_factory=RejectionSamplingInitConfig)
    data: PromptDataConfig = field(
        default_factory=PromptDataConfig
    )  # the training prompts (the held-out ones are not sampled)
    reward: RewardConfig = field(
        default_factory=lambda: RewardConfig(terms=[RewardTermConfig("checker", "data.demo.scoring:score_example")])
    )
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sft: SFTConfig = field(default_factory=rejection_sampling_sft)
