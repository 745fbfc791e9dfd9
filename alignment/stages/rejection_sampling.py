"""Rejection sampling (``run_rejection_sampling``): sample K responses per training prompt from the SFT policy, score
them, keep the best per prompt (``select_best``), then fine-tune on them (SFT's ``fine_tune``), in one run folder.
A rerun whose sampling hash (``sampling_digest``) matches skips sampling."""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from alignment.schemas.rejection_sampling import RejectionSamplingConfig
from alignment.schemas.sft import SFTConfig
from alignment.shared.episodes import Environment, schemas
from alignment.shared.rewards import build_reward
from alignment.shared.sampling import sample_and_score, sample_and_score_episodes
from alignment.stages.registry import REJECTION_SAMPLING, Stage
from alignment.stages.sft import fine_tune
from data.records.prompts import PromptDataModule, record_to_prompt
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError, DataError, LanternError
from models.files.atomic import write_atomically
from models.files.checksums import sha256_file
from models.files.digests import content_key, folder_fingerprint
from models.formats.checkpoint import load_checkpoint, load_model_config
from models.model import ModelConfig
from trainer.build import check_stage_config, run_directory
from trainer.checkpoints import latest_checkpoint
from trainer.config import RunConfig, to_dict
from trainer.storage import claim_run_directory, is_global_rank_zero, lock_run_directory, release_run_directory

log = logging.getLogger(__name__)

SAMPLES, STATS = "samples.jsonl", "sampling.json"
FORMAT = 1  # of samples.jsonl and sampling.json; part of the hash
WAIT_SECONDS = 2.0  # how often a rank waiting for rank 0's sampling looks for it


def select_best(
    scores: Sequence[float | None], lengths: Sequence[int], keep: int, min_score: float | None
) -> list[int]:
    """Indices of the ``keep`` best samples of one prompt, best first: the highest score, ties to the shorter,
    then the first. A score of None (a sample that may not be kept) and any score below ``min_score`` are
    never chosen, so fewer than ``keep`` (or none) may come back."""
    eligible = [
        i
        for i, score in enumerate(scores)
        if score is not None and math.isfinite(score) and (min_score is None or score >= min_score)
    ]
    return sorted(eligible, key=lambda i: (-scores[i], lengths[i], i))[:keep]


def pass_at_k(best: Sequence[float], all_scores: Sequence[float], min_score: float | None) -> float | None:
    """The share of prompts with at least one passing sample: best >= ``min_score``, or, without one, best == 1
    when every score is 0 or 1 (a checker's verdicts); None when nothing says what passing is."""
    if min_score is not None:
        return sum(b >= min_score for b in best) / len(best)
    if all(s in (0.0, 1.0) for s in all_scores):
        return sum(b == 1.0 for b in best) / len(best)
    return None


# ---- config ----


def check_config(config: RejectionSamplingConfig, tokenizer: Tokenizer, stage: Stage) -> ModelConfig:
    """Everything checkable before loading weights; returns the policy's ModelConfig."""
    sampling, sft = config.sampling, config.sft
    if not config.init.policy:
        raise ConfigError("init.policy is required: the SFT model folder to sample from and fine-tune")
    if sampling.keep_per_prompt > sampling.samples_per_prompt:
        raise ConfigError(
            f"sampling.keep_per_prompt ({sampling.keep_per_prompt}) exceeds sampling.samples_per_prompt "
            f"({sampling.samples_per_prompt})"
        )
    if sft.init.checkpoint or sft.data.train:
        raise ConfigError("sft.init.checkpoint and sft.data.train are set by the stage (init.policy, the samples)")
    if sft.run != RunConfig():
        raise ConfigError("sft.run is the stage's run section: set run.name / run.out_dir / run.seed instead")
    if sft.data.tokenizer not in ("auto", "default", config.data.tokenizer):
        raise ConfigError(f"sft.data.tokenizer ({sft.data.tokenizer}) must be data.tokenizer ({config.data.tokenizer})")
    try:
        model = load_model_config(config.init.policy)
    except (OSError, ValueError) as error:
        raise ConfigError(f"init.policy: {error}") from error
    stage.check_row_tokens(config, model.max_seq_len, "the policy's max_seq_len")
    longest = config.data.max_prompt_tokens + sampling.response_max_tokens
    if (episodes := stage.episodes(config)) is not None:  # an episode is one sample
        longest = episodes.max_tokens
    if longest > sft.data.seq_len:
        log.warning(
            "a sample may reach %d tokens, more than sft.data.seq_len (%d): long samples are %s",
            longest, sft.data.seq_len, "dropped" if sft.data.too_long == "drop" else "truncated",
        )  # fmt: skip
    return model


def sft_config(config: RejectionSamplingConfig, samples: Path, model: ModelConfig) -> SFTConfig:
    """The SFT section with what the stage sets: the run, the policy to start from, the samples, the tokenizer."""
    sft = copy.deepcopy(config.sft)
    sft.run = copy.deepcopy(config.run)
    sft.init.checkpoint = config.init.policy
    sft.model = model  # what the checkpoint holds (SFT would warn that a different model section is ignored)
    sft.data.train = [str(samples)]
    sft.data.tokenizer = config.data.tokenizer
    return sft


def load_training_prompts(config: RejectionSamplingConfig) -> list[dict[str, Any]]:
    """The training prompts (``data``, less its held-out part), or the seeded subset ``sampling.prompts``."""
    datamodule = PromptDataModule(config.data, batch_size=config.sampling.batch_size)
    try:
        datamodule.setup()
    except LanternError:
        raise
    except ValueError as error:
        raise DataError(f"data.train: {error}") from error
    prompts = datamodule.train_prompts
    wanted = config.sampling.prompts
    if wanted and wanted < len(prompts):
        chosen = sorted(random.Random(config.run.seed).sample(range(len(prompts)), wanted))
        prompts = [prompts[i] for i in chosen]
    elif wanted > len(prompts):
        log.warning("sampling.prompts=%d but there are %d training prompts: sampling all", wanted, len(prompts))
    return prompts


# ---- resume ----


def sampling_digest(config: RejectionSamplingConfig, prompts: list[dict[str, Any]], tokenizer: Tokenizer) -> str:
    """The hash of what decides the samples: the data, reward and sampling sections, run.seed, the prompts as
    encoded, the tokenizer, and the names, sizes and mtimes of the models' files (not the ``sft.`` keys)."""
    settings = {key: to_dict(getattr(config, key)) for key in ("data", "reward", "sampling", "episodes")}
    models = [config.init.policy] + [t.path for t in config.reward.terms if t.kind == "reward_model" and t.path]
    return content_key(
        [FORMAT, settings, config.run.seed, tokenizer.fingerprint],
        [folder_fingerprint(path) for path in models],
        [[prompt["prompt_ids"], prompt["record"]] for prompt in prompts],
    )


def sampling_done(run_dir: Path, digest: str) -> bool:
    """Whether ``run_dir`` holds finished samples made with ``digest`` (and samples.jsonl is the file recorded)."""
    try:
        stats = json.loads((run_dir / STATS).read_text())
        return stats.get("hash") == digest and stats.get("samples_sha256") == sha256_file(run_dir / SAMPLES)
    except (OSError, ValueError, AttributeError):
        return False


def wait_for_rank_zero(run_dir: Path, digest: str) -> None:
    """A rank started beside rank 0 (torchrun, SLURM) waits until rank 0 has written the samples."""
    waited = 0.0
    while not sampling_done(run_dir, digest):
        if waited % 60 < WAIT_SECONDS:
            log.info("waiting for global rank 0 to finish sampling into %s", run_dir)
        time.sleep(WAIT_SECONDS)
        waited += WAIT_SECONDS


# ---- sampling ----


@torch.no_grad()
def keep_best(
    config: RejectionSamplingConfig,
    prompts: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """SFT chat records of the kept samples (prompt order, best first) and the statistics of the sampling. A tool
    episode's record is its transcript with ``tools`` (the environment's schemas): SFT trains on the policy's turns
    alone."""
    sampling, k = config.sampling, config.sampling.samples_per_prompt
    records, best, prompts_kept = [], [], 0
    for index, prompt in enumerate(prompts):
        group = samples[index * k : (index + 1) * k]
        seen: set[str] = set()
        scores: list[float | None] = []
        for sample in group:  # only distinct, non-empty (and, by default, finished) answers may be kept
            keepable = sample["answer"].strip() and sample["answer"] not in seen
            keepable = keepable and (sample["ended"] or sampling.keep_truncated)
            scores.append(sample["score"] if keepable else None)
            seen.add(sample["answer"])
        chosen = select_best(scores, [s["tokens"] for s in group], sampling.keep_per_prompt, sampling.min_score)
        messages = record_to_prompt(prompt["record"], config.data)[0]
        for place, sample_index in enumerate(chosen):
            sample = group[sample_index]
            # an episode's whole transcript, or the prompt's messages and the answer
            conversation = sample.get("messages") or [*messages, {"role": "assistant", "content": sample["answer"]}]
            records.append(
                {
                    "messages": conversation,
                    **({"tools": tools} if tools else {}),
                    "score": sample["score"],
                    "scores": sample["scores"],
                    "place": place,  # 0: the best of the prompt's samples
                    "source": prompt["where"],
                }
            )
        prompts_kept += bool(chosen)
        best.append(max(s["score"] for s in group))
    all_scores = [s["score"] for s in samples]
    stats = {
        "prompts": len(prompts),
        "samples": len(samples),
        "kept": len(records),
        "prompts_kept": prompts_kept,
        "mean_best_score": sum(best) / len(best),
        "mean_score": sum(all_scores) / len(all_scores),
        "mean_kept_score": sum(r["score"] for r in records) / len(records) if records else None,
        "samples_per_prompt": k,
        "pass_at_k": pass_at_k(best, all_scores, sampling.min_score),  # k = samples_per_prompt
        "ended_share": sum(s["ended"] for s in samples) / len(samples),
        "mean_response_tokens": sum(s["tokens"] for s in samples) / len(samples),
        "term_means": {name: sum(s["scores"][name] for s in samples) / len(samples) for name in samples[0]["scores"]},
    }
    if "messages" in samples[0]:  # tool episodes: means per episode
        for key in ("turns", "tool_calls", "malformed_calls"):
            stats[f"mean_{key}"] = sum(s[key] for s in samples) / len(samples)
    return records, stats


def run_sampling(
    config: RejectionSamplingConfig,
    tokenizer: Tokenizer,
    prompts: list[dict],
    run_dir: Path,
    digest: str,
    environment: Environment | None = None,
) -> dict[str, Any]:
    """Load the policy and the reward, sample and score (tool episodes with ``environment``; sharded when
    torch.distributed is initialised), keep the best and, on rank 0, write samples.jsonl then sampling.json. Returns
    the statistics."""
    started = time.perf_counter()
    reward = build_reward(config.reward.terms)
    on_gpu = torch.cuda.is_available() and config.sft.trainer.accelerator != "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu and config.sft.trainer.precision.startswith("bf16") else torch.float32
    policy = load_checkpoint(config.init.policy, device=device, dtype=dtype)
    reward.place(device, dtype)
    sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    mine = list(range(rank, len(prompts), world))
    sampling, episodes = config.sampling, config.episodes
    common = {
        "samples_per_prompt": sampling.samples_per_prompt, "temperature": sampling.temperature,
        "top_k": sampling.top_k, "top_p": sampling.top_p, "batch_size": sampling.batch_size, "seed": config.run.seed,
        "rank": rank,
    }  # fmt: skip
    if environment is not None:
        samples = sample_and_score_episodes(
            policy, tokenizer, reward, environment, [prompts[i] for i in mine], turn_tokens=sampling.response_max_tokens,
            max_turns=episodes.max_turns, episode_tokens=episodes.max_tokens, **common,
        )  # fmt: skip
    else:
        samples = sample_and_score(
            policy, tokenizer, reward, [prompts[i] for i in mine], response_max_tokens=sampling.response_max_tokens,
            compile=config.sft.trainer.compile, **common,
        )  # fmt: skip
    unjudged = reward.unjudged  # samples a checker could not judge (scored 0)
    del policy, reward
    if on_gpu:
        torch.cuda.empty_cache()
    if sharded:  # back into prompt order: rank r sampled prompts r, r + world, ...
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (mine, samples, unjudged))
        k, ordered = config.sampling.samples_per_prompt, [{}] * (len(prompts) * config.sampling.samples_per_prompt)
        unjudged = sum(part[2] for part in gathered)
        for indices, part, _ in gathered:
            for position, index in enumerate(indices):
                ordered[index * k : (index + 1) * k] = part[position * k : (position + 1) * k]
        samples = ordered
    records, stats = keep_best(config, prompts, samples, schemas(environment) if environment is not None else None)
    if not records:
        raise DataError(
            f"no sample of the {len(prompts)} prompts can be kept (min_score {config.sampling.min_score}, "
            f"mean best score {stats['mean_best_score']:.3f}, {stats['ended_share']:.0%} ended with an end of turn): "
            "lower sampling.min_score, raise sampling.samples_per_prompt or sampling.response_max_tokens"
        )
    stats["unjudged"] = unjudged
    stats["wall_seconds"] = time.perf_counter() - started
    if rank == 0:
        text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        write_atomically(run_dir / SAMPLES, text, what="rejection samples")
        stats["samples_file"] = str(run_dir / SAMPLES)
        summary = {"format": FORMAT, "hash": digest, **stats}
        summary["samples_sha256"] = sha256_file(run_dir / SAMPLES)
        summary["config"] = to_dict(config)
        write_atomically(run_dir / STATS, json.dumps(summary, indent=2) + "\n", what="sampling statistics")
    if sharded:
        dist.barrier()
    log.info(
        "kept %d samples of %d prompts (mean best score %.3f, mean score %.3f, pass@%d %s) in %.0f s",
        stats["kept"], stats["prompts"], stats["mean_best_score"], stats["mean_score"],
        stats["samples_per_prompt"], stats["pass_at_k"], stats["wall_seconds"],
    )  # fmt: skip
    return stats


# ---- the recipe ----


def run_rejection_sampling(config: RejectionSamplingConfig, *, stage: Stage = REJECTION_SAMPLING) -> Path | None:
    """Check the config, sample (unless finished with the same hash), keep the best, then run SFT on them;
    returns the run folder on rank 0, else None. ``stage``: its record (a variant's own)."""
    check_stage_config(config, stage.model_folders(config), config.sft.trainer)  # before anything is created
    plan = stage.preflight(config)  # before any weights load
    tokenizer = Tokenizer.load(config.data.tokenizer)
    environment = stage.environment(config)  # multi-turn tool episodes, or None
    model = check_config(config, tokenizer, stage)
    prompts = load_training_prompts(config)
    digest = sampling_digest(config, prompts, tokenizer)
    run_dir = run_directory(config.run.out_dir, config.run.name)
    sharded = dist.is_available() and dist.is_initialized()
    leader = dist.get_rank() == 0 if sharded else is_global_rank_zero()
    claim_run_directory(run_dir, stage.name)  # before anything is written into it
    if leader:
        lock_run_directory(run_dir)  # held on through fine_tune (same process), released by its fit_stage
    try:
        if sampling_done(run_dir, digest):
            log.info("sampling in %s is finished with this config and these inputs: not sampling again", run_dir)
        elif leader or sharded:
            if config.sft.checkpoint.resume == "auto" and latest_checkpoint(run_dir / "checkpoints") is not None:
                raise ConfigError(
                    f"{run_dir} holds SFT checkpoints trained on samples made with another sampling config or "
                    "other inputs: set run.name to a new folder, or sft.checkpoint.resume=none to sample again and "
                    "fine-tune from the start"
                )
            run_sampling(config, tokenizer, prompts, run_dir, digest, environment)
        else:
            wait_for_rank_zero(run_dir, digest)
    except BaseException:
        release_run_directory(run_dir)
        raise
    return fine_tune(sft_config(config, run_dir / SAMPLES, model), stage=stage, plan=plan)
