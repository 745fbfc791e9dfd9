"""The pipeline's held-out evaluation: every language model it trained answers all the same held-out prompts greedily,
with one token budget and one checker, so the numbers compare; the SFT model and each stage after it also get pass@k
and their KL to the model they started from, and every model the lm-eval tasks of ``report.harness_tasks``. Each
stage's results are cached in ``report/eval-STAGE.json`` under the stage's hash and the evaluation settings, so a
re-run that changed one stage re-evaluates only that one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from alignment.commands.pipeline_records import read_json
from alignment.shared.episodes import (
    Environment,
    Episode,
    episode_stats,
    generate_sampler,
    load_environment,
    run_episodes,
)
from alignment.shared.evaluation import (
    SampledKL,
    heldout_summary,
    json_safe,
    mean_score,
    paired_difference,
    pass_at_k_summary,
    sample_answers,
    verdict,
)
from alignment.shared.rewards import load_checker
from alignment.stages import registry
from data.records.prompts import PromptDataConfig, load_prompts
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError
from models.files.atomic import write_atomically
from models.files.digests import content_key
from models.formats.checkpoint import load_checkpoint
from trainer.checks import resolve_stage_tokenizer

if TYPE_CHECKING:  # for annotations only: alignment.commands.pipeline imports the report, which imports this module
    from alignment.commands.pipeline import Pipeline, ReportSection


def policy_stages() -> list[str]:
    """The stages whose final/ is a language model the report scores, in pipeline order."""
    return [stage.name for stage in registry.STAGES if stage.language_model]


def heldout_prompts(demo: Path, report: ReportSection, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """The demo's held-out prompts (``prompts.jsonl``, its val split: never trained on by any stage), encoded."""
    config = PromptDataConfig(tokenizer=str(tokenizer.path), max_prompt_tokens=report.max_prompt_tokens)
    return load_prompts(config, [str(demo / "prompts.jsonl")], tokenizer)[0]


def evaluate_stage(
    report: ReportSection,
    stage: str,
    path: Path,
    prompts: list[dict[str, Any]],
    tokenizer: Tokenizer,
    reference: Path | None,
    sampled: bool | None = None,
) -> dict[str, Any]:
    """Greedy answers and their scores, pass@k and the KL to ``reference`` (the model the stages after SFT started
    from, estimated on the pass@k samples), for one stage's final model; ``sampled`` (default: all but the
    pretrained base) adds the samples."""
    checker = load_checker(report.checker, "report.checker")
    environment = load_environment(report.episodes.environment, "report.episodes.environment")
    model = load_checkpoint(path).eval()
    budget = max(1, min(report.max_new_tokens, model.config.max_seq_len - max(len(p["prompt_ids"]) for p in prompts)))
    ids = [p["prompt_ids"] for p in prompts]
    result: dict[str, Any] = {}
    if environment is not None:
        episodes = play_episodes(report, environment, model, tokenizer, prompts, f"report: {stage} greedy episodes")
        answers = [episode.answer for episode in episodes]
        result.update(episodes=episode_stats(episodes), transcripts=[transcript(e) for e in episodes])
    else:
        answers = [
            a[0]
            for a in sample_answers(
                model, tokenizer, ids, max_new_tokens=budget, batch_size=report.batch_size,
                progress=f"report: {stage} greedy answers",
            )
        ]  # fmt: skip
    scores = [checker(p["record"], a) if checker else None for p, a in zip(prompts, answers)]
    result.update(heldout=heldout_summary(prompts, scores), answers=answers, scores=scores)
    generator = torch.Generator().manual_seed(report.seed)
    # what a stage after SFT cost: its KL to the model it started from, on the samples drawn below (single-turn
    # samples only: over episodes the log-ratio would need the observations masked out, which is not built)
    kl = (
        SampledKL(load_checkpoint(reference).eval(), tokenizer)
        if reference and stage not in ("pretrain", "sft") and environment is None
        else None
    )
    if report.pass_k and checker is not None and (stage != "pretrain" if sampled is None else sampled):
        subset = prompts[: report.pass_k_prompts] if report.pass_k_prompts else prompts
        if environment is not None:  # k sampled episodes a prompt
            repeated = [p for p in subset for _ in range(report.pass_k)]
            played = play_episodes(
                report, environment, model, tokenizer, repeated, f"report: {stage} sampled episodes", generator
            )
            samples = [
                [e.answer for e in played[i * report.pass_k : (i + 1) * report.pass_k]] for i in range(len(subset))
            ]
        else:
            samples = sample_answers(
                model, tokenizer, [p["prompt_ids"] for p in subset], max_new_tokens=budget,
                batch_size=report.batch_size, samples=report.pass_k, temperature=1.0, generator=generator, on_batch=kl,
                progress=f"report: {stage} sampled answers",
            )  # fmt: skip
        sample_scores = [[checker(p["record"], a) for a in group] for p, group in zip(subset, samples)]
        result["pass_at_k"] = pass_at_k_summary(subset, sample_scores, report.pass_k)
        # the mean score of a prompt's k samples: pass@1 of the sampling policy (what RL optimises), per prompt so
        # that stages pair over the same prompts, with k times fewer coin flips in it than one greedy answer
        result["sampled_scores"] = [mean_score(scores) for scores in sample_scores]
        result["sampled"] = {
            **heldout_summary(subset, result["sampled_scores"]), "samples": report.pass_k, "temperature": 1.0
        }  # fmt: skip
    elif kl is not None:  # no samples to reuse: one per prompt for the KL alone
        sample_answers(
            model, tokenizer, ids, max_new_tokens=budget, batch_size=report.batch_size, temperature=1.0,
            generator=generator, on_batch=kl, progress=f"report: {stage} samples for the KL",
        )  # fmt: skip
    if report.harness_tasks:  # lm-eval's tasks, as `lantern eval` scores them
        from trainer.harness import flat_metrics
        from trainer.harness_validation import HarnessScorer

        result["harness"] = flat_metrics(HarnessScorer(report, tokenizer, key="report.").results(model))
    result["kl"] = kl.value if kl is not None else None
    return result


def play_episodes(
    report: ReportSection,
    environment: Environment,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompts: list[dict[str, Any]],
    progress: str,
    generator: torch.Generator | None = None,
) -> list[Episode]:
    """Each prompt's tool episode (``report.episodes``; ``report.max_new_tokens`` a turn), in batches of
    ``report.batch_size``: greedy, or sampled at temperature 1 from ``generator``. The environment's rng starts from
    ``report.seed`` each time, so a model's episodes do not depend on what was scored before it."""
    environment.rng.seed(report.seed)
    sample = generate_sampler(model, tokenizer, generator, temperature=0.0 if generator is None else 1.0)
    limits = {
        "max_turns": report.episodes.max_turns,
        "turn_tokens": report.max_new_tokens,
        "episode_tokens": min(report.episodes.max_tokens, model.config.max_seq_len),
    }
    episodes: list[Episode] = []
    with torch.no_grad(), tqdm(total=len(prompts), desc=progress, unit="episode") as bar:
        for start in range(0, len(prompts), report.batch_size):
            episodes += run_episodes(
                environment, tokenizer, prompts[start : start + report.batch_size], sample, **limits
            )
            bar.update(min(report.batch_size, len(prompts) - start))
    return episodes


def transcript(episode: Episode) -> dict[str, Any]:
    """What the report keeps of an episode: its messages (the first ``opening`` of them the environment's), how it
    ended, and its calls."""
    return {
        "messages": episode.messages, "opening": episode.opening, "ended": episode.ended, "turns": episode.turns,
        "tool_calls": episode.tool_calls, "malformed_calls": episode.malformed_calls,
    }  # fmt: skip


def scoring_inputs(pipeline: Pipeline) -> tuple[Path, Tokenizer, list[dict[str, Any]]]:
    """What scoring other models beside a finished pipeline's SFT model needs: (the SFT model's folder, the
    tokenizer, the held-out prompts). The demo files are written first where missing (their hash is part of the
    evaluation's key); ones written with other demo settings than the config's are refused (DataError), and so is a
    pipeline folder without a finished SFT stage of this config (ConfigError)."""
    pipeline.write_demo(only_if_current=True)
    sft = pipeline.upstream("sft")[0]
    if sft is None or sft != pipeline.stage_dir("sft") / "final":
        raise ConfigError(f"{pipeline.root} has no finished SFT stage of this pipeline config: run the pipeline first")
    tokenizer = Tokenizer.load(tokenizer_spec(pipeline.load_stage_config("sft")[0]))
    return sft, tokenizer, heldout_prompts(pipeline.demo, pipeline.config.report, tokenizer)


def tokenizer_spec(config: Any, stage: str = "sft") -> str:
    """The tokenizer the config of ``stage`` names, ``auto`` resolved to its starting checkpoint's (as the stage
    resolves it when it runs, which a skipped stage did not)."""
    record = registry.find_stage(stage)
    resolve_stage_tokenizer(config, *(record.model_folders(config) if record else (None, [])))
    return str(config.data.tokenizer)


def score_sft(pipeline: Pipeline) -> tuple[Path, Tokenizer, list[dict[str, Any]], dict[str, Any]]:
    """``scoring_inputs`` and the SFT model's results, scored as the report scores it."""
    sft, tokenizer, prompts = scoring_inputs(pipeline)
    return sft, tokenizer, prompts, evaluate_stage(pipeline.config.report, "sft", sft, prompts, tokenizer, None)


def evaluate_models(pipeline: Pipeline) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(the held-out prompts, {stage: results}) for every policy stage whose final model exists, from the cache
    where it is current."""
    stages = [s for s in policy_stages() if s in pipeline.config.stages or pipeline.upstream(s)[0] is not None]
    finals = {s: pipeline.upstream(s) for s in stages}
    if pipeline.config.align_from == "start" and finals.get("sft", (None,))[0] != pipeline.stage_dir("sft") / "final":
        finals.pop("sft", None)  # no SFT control of its own: start_checkpoint is scored once, as the base
    finals = {s: (path, digest) for s, (path, digest) in finals.items() if path is not None and path.is_dir()}
    if not finals:
        return [], {}
    loaded = next((s for s in ("sft", "pretrain", *pipeline.configs) if s in pipeline.configs), None)
    spec = tokenizer_spec(pipeline.configs[loaded], loaded) if loaded else "default"
    tokenizer = Tokenizer.load(spec)
    prompts = heldout_prompts(pipeline.demo, pipeline.config.report, tokenizer)
    # the KL of each stage after SFT is to the model it started from
    start = "start" if pipeline.config.align_from == "start" else "sft"
    reference, reference_digest = pipeline.upstream("start") if start == "start" else finals.get("sft", (None, ""))
    results, report = {}, str(pipeline.config.report)
    for stage, (path, digest) in finals.items():
        # a start model the stages align from is sampled like them: their sampled gains are measured against it
        sampled = stage != "pretrain" or start == "start"
        cache = pipeline.root / "report" / f"eval-{stage}.json"
        key = content_key(spec, pipeline.demo_hash, report, digest, start, reference_digest, str(sampled))
        if (cached := read_json(cache)) and cached.get("key") == key:
            results[stage] = cached["result"]
            continue
        results[stage] = evaluate_stage(pipeline.config.report, stage, path, prompts, tokenizer, reference, sampled)
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(
            cache, json.dumps({"key": key, "result": json_safe(results[stage])}) + "\n", what="report evaluation"
        )
    compare_with(results, "sft", "vs_sft")
    if start == "start":  # every model against the one it started from, too
        compare_with(results, "pretrain", "vs_base")
    return prompts, results


PER_PROMPT = ("answers", "scores", "sampled_scores", "transcripts")  # lists over the prompts, kept out of summaries


def without_per_prompt(result: dict[str, Any]) -> dict[str, Any]:
    """A stage's results without its per-prompt lists: what a summary JSON holds."""
    return {key: value for key, value in result.items() if key not in PER_PROMPT}


def compare_with(results: dict[str, dict[str, Any]], baseline: str, key: str) -> None:
    """Each other model's ``KEY`` (greedy) and ``KEY_sampled`` (mean of k samples): its paired difference from the
    ``baseline`` stage's model over the same prompts, with a verdict."""
    if baseline not in results:
        return
    for stage, result in results.items():
        if stage == baseline:
            continue
        for scores, name in (("scores", key), ("sampled_scores", f"{key}_sampled")):
            if scores in result and scores in results[baseline]:
                difference, se, n = paired_difference(result[scores], results[baseline][scores])
                result[name] = {"difference": difference, "se": se, "n": n, "verdict": verdict(difference, se)}
