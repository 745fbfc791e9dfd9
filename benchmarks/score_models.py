"""Score any language models exactly as a pipeline's report scores its own (alignment/commands/pipeline_eval.py): the same
held-out prompts, checker, token budget and seeds; greedy accuracy, sampled accuracy (the mean of k samples at
temperature 1), pass@k, KL to the pipeline's SFT model; each paired with the SFT model over the same prompts and
called a gain or a loss only beyond 2 standard errors. For RL runs made outside the pipeline, e.g.

    lantern grpo configs/grpo/shakespeare.yaml init.policy=runs/pipeline-default/sft/final \\
        data.train=[runs/pipeline-default/data/demo/train_prompts.jsonl] \\
        data.val=[runs/pipeline-default/data/demo/prompts.jsonl] run.out_dir=runs/try optim.lr=3e-4
    python -m benchmarks.score_models --pipeline runs/pipeline-default grpo-3e-4=runs/try/grpo-shakespeare/final

Writes ``score_models.md`` (the report's table) and ``score_models.json`` (the numbers without per-prompt lists)
into ``--out`` (default PIPELINE/score-models). The accuracies are deterministic for one machine, thread count
and torch build; another of any of them changes the kernels' rounding and so the samples.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from alignment.commands.pipeline import Pipeline, load_pipeline_config
from alignment.commands.pipeline_eval import compare_with, evaluate_stage, score_sft, without_per_prompt
from alignment.commands.pipeline_report import comparison_lines
from alignment.shared.evaluation import json_safe
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError, DataError
from models.files.atomic import write_atomically


def open_pipeline(
    config_path: str, root: Path, overrides: list[str]
) -> tuple[Pipeline, Path, Tokenizer, list[dict[str, Any]], dict[str, Any]]:
    """The finished pipeline in ``root`` (run with ``config_path`` and ``overrides``) and its SFT model scored as
    its report scores it: (pipeline, SFT folder, tokenizer, held-out prompts, SFT results). Every model is compared
    with the pipeline's own SFT model, so a start_checkpoint, which would stand in for it, is dropped. No finished
    SFT stage, or demo data written with other settings, exits with one line."""
    pipeline = pipeline_at(config_path, root, overrides)
    try:
        return pipeline, *score_sft(pipeline)
    except (ConfigError, DataError) as error:
        raise SystemExit(f"{error} (`lantern pipeline {config_path}`)") from None


def pipeline_at(config_path: str, root: Path, overrides: list[str]) -> Pipeline:
    """The pipeline of ``config_path`` (with ``overrides``) in the folder ``root``, for scoring beside its own SFT
    model: a start_checkpoint, which would stand in for that model, is dropped."""
    config = load_pipeline_config(config_path, [*overrides, f"out_dir={root}", "logger.kind=csv"])
    config.start_checkpoint = None
    return Pipeline(config)


def named_models(pairs: list[str]) -> dict[str, Path]:
    """``NAME=PATH`` arguments as {name: folder}; each folder must hold a final model (lantern.json)."""
    models: dict[str, Path] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"expected NAME=PATH, got {pair!r}")
        if name in models or name == "sft":
            raise SystemExit(f"model name {name!r} is used twice (sft is the pipeline's own SFT model)")
        if not (Path(path) / "lantern.json").is_file():
            raise SystemExit(f"{name}: {path} is not a model folder (no lantern.json)")
        models[name] = Path(path)
    return models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.score_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True, help="a pipeline folder with a finished SFT stage")
    parser.add_argument("--config", default="configs/pipeline/default.yaml", help="the pipeline config it ran with")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override the pipeline ran with (repeatable)"
    )
    parser.add_argument("--out", default=None, help="default: PIPELINE/score-models")
    parser.add_argument("models", nargs="+", metavar="NAME=PATH", help="models to score beside the SFT model")
    args = parser.parse_args(argv)

    models = named_models(args.models)
    root = Path(args.pipeline)
    pipeline, sft, tokenizer, prompts, sft_results = open_pipeline(args.config, root, args.set)
    config = pipeline.config
    results = {"sft": sft_results}
    for name, path in models.items():
        results[name] = evaluate_stage(config.report, name, path, prompts, tokenizer, sft)
    compare_with(results, "sft", "vs_sft")

    table = "\n".join(comparison_lines(results, {}, config.report.pass_k))
    print(f"\n{len(prompts)} held-out prompts\n\n{table}")
    summary = {
        "heldout_prompts": len(prompts),
        "models": {name: str(path) for name, path in {"sft": sft, **models}.items()},
        "results": {name: without_per_prompt(result) for name, result in results.items()},
    }
    out = Path(args.out) if args.out else root / "score-models"
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "score_models.json", json.dumps(json_safe(summary), indent=2) + "\n", what="results")
    write_atomically(out / "score_models.md", table + "\n", what="results table")
    print(f"\nwrote {out / 'score_models.json'}, {out / 'score_models.md'}")


if __name__ == "__main__":
    main()
