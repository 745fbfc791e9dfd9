"""The schema of ``lantern rejection-sampling``: K samples per training prompt scored by the reward, the best kept,
then SFT on them through the embedded ``sft`` section (every SFT key under ``sft.``, bar what the stage sets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from alignment.schemas.rl import EpisodeConfig, RewardConfig, RewardTermConfig
from alignment.schemas.sft import SFTConfig
from data.records.prompts import PromptDataConfig
from models.config_checks import bounded
from trainer.config import RunConfig


@dataclass
class RejectionSamplingInitConfig:
    policy: str | None = None  # the SFT model folder: sampled from, and the start of the fine-tuning


@dataclass
class SamplingConfig:
    samples_per_prompt: int = bounded(8, ge=1)  # K responses sampled per training prompt
    keep_per_prompt: int = bounded(1, ge=1)  # the best this many distinct responses of each prompt become SFT examples
    min_score: float | None = bounded(None)  # keep a response only if its reward is >= this (1.0: only correct ones)
    keep_truncated: bool = False  # keep responses cut at response_max_tokens (no end of turn) too
    temperature: float = bounded(1.0, ge=0)
    top_k: int | None = bounded(None, ge=1)
    top_p: float | None = bounded(None, gt=0, le=1)
    response_max_tokens: int = bounded(128, ge=1)
    batch_size: int = bounded(8, ge=1)  # prompts per generation call (each sampled K times: batch_size * K rows)
    prompts: int = bounded(0, ge=0)  # training prompts sampled: 0 = all of them, else a subset seeded by run.seed


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
    # environment set: each sample is a tool episode (sampling.response_max_tokens a turn) and the kept transcripts
    # are SFT rows with their tools, trained on the policy's turns alone (docs/tools.md)
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    sft: SFTConfig = field(default_factory=rejection_sampling_sft)
