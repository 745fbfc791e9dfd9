"""PPO, GRPO, RLOO, DPO and rejection sampling from the same SFT model at a comparable sample budget: held-out
accuracy ± SE (greedy, and the mean of k samples at temperature 1), the paired difference from SFT (a gain only
beyond 2 SE), pass@k, KL to the SFT model and wall time, as a table (printed, and written as markdown), JSON and
a PNG.

    lantern pipeline configs/pipeline/default.yaml            # once: the SFT model, reward model and demo data
    python -m benchmarks.alignment_compare --pipeline runs/pipeline-default [--samples 1024] [--out DIR]

Every method runs its stage exactly as the pipeline would (the same preset, the same overrides, the same wiring
to the SFT model, reward model and demo data: ``Pipeline.load_stage_config``), and every final model is scored
exactly as the pipeline's report scores it (``alignment.commands.pipeline_eval.evaluate_stage``), so the methods differ only
in their algorithm and in the number of steps the budget buys. The budget counts responses the method learns
from: PPO rollouts × prompts; GRPO/RLOO rollouts × prompts × group size; rejection sampling prompts × K samples;
DPO optimizer steps × pairs × 2 (its responses come from the preference data, not from the policy). Wall time
is each stage's own, measured in this run; it varies with the machine and its load, the accuracies do not (the
same machine, threads and seeds give the same numbers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from alignment.commands.pipeline_eval import compare_with, evaluate_stage, without_per_prompt
from alignment.commands.pipeline_report import comparison_lines
from alignment.shared.evaluation import json_safe
from alignment.stages.registry import stage_named
from benchmarks.score_models import open_pipeline
from models.files.atomic import write_atomically

# method -> (the pipeline stage that runs it, overrides that make it this method)
METHODS: dict[str, tuple[str, list[str]]] = {
    "ppo": ("ppo", []),
    "grpo": ("grpo", ["grpo.baseline=grpo"]),
    "rloo": ("grpo", ["grpo.baseline=rloo"]),
    "dpo": ("dpo", []),
    "rejection_sampling": ("rejection_sampling", []),
}


def apply_budget(stage: str, config: Any, samples: int) -> int:
    """Set the steps (or prompts) ``samples`` responses buy; returns the responses actually used."""
    if stage == "ppo":
        config.trainer.max_steps = max(1, samples // config.ppo.rollout_batch_size)
        return config.trainer.max_steps * config.ppo.rollout_batch_size
    if stage == "grpo":
        per_rollout = config.grpo.prompts_per_rollout * config.grpo.group_size
        config.trainer.max_steps = max(1, samples // per_rollout)
        return config.trainer.max_steps * per_rollout
    if stage == "rejection_sampling":
        config.sampling.prompts = max(1, samples // config.sampling.samples_per_prompt)
        return config.sampling.prompts * config.sampling.samples_per_prompt
    if stage == "dpo":
        per_step = 2 * config.loader.micro_batch_size * config.trainer.accumulate_grad_batches
        config.trainer.max_steps = max(1, samples // per_step)
        return config.trainer.max_steps * per_step
    raise ValueError(f"no budget rule for stage {stage!r}")


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Held-out accuracy with 2-SE error bars, and KL to the SFT model, per method."""
    import matplotlib  # deferred, with its backend chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    positions, width = range(len(names)), 0.4
    for offset, key, label, color in ((-0.2, "heldout", "greedy", "C0"), (0.2, "sampled", "sampled (T=1)", "C2")):
        summaries = [results[n].get(key) for n in names]
        if None in summaries:  # not measured (report.pass_k 0): no bars, rather than bars of zero
            continue
        left.bar([p + offset for p in positions], [s["accuracy"] for s in summaries], width,
                 yerr=[2 * s["se"] for s in summaries], capsize=3, color=color, label=label)  # fmt: skip
    left.set_xticks(list(positions), names)
    left.set(title="held-out accuracy (ground truth) ± 2 SE", ylabel="mean score")
    left.legend()
    right.bar(names, [results[n].get("kl") or 0.0 for n in names], color="C1")
    right.set(title="KL to the SFT model (nats per response)", ylabel="KL")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.alignment_compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pipeline", required=True, help="a finished pipeline folder (its sft/, rm/, data/demo/)")
    parser.add_argument("--config", default="configs/pipeline/default.yaml", help="the pipeline config it ran with")
    parser.add_argument("--samples", type=int, default=1024, help="responses each method learns from")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", default=None, help="default: PIPELINE/alignment-compare")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="pipeline config overrides (STAGE.KEY=V)")
    args = parser.parse_args(argv)

    root = Path(args.pipeline)
    out = Path(args.out) if args.out else root / "alignment-compare"
    # every method starts from the pipeline's own SFT model, with the pipeline's presets, overrides and wiring
    pipeline, sft, tokenizer, prompts, sft_results = open_pipeline(args.config, root, args.overrides)
    config = pipeline.config
    results = {"sft": sft_results}
    seconds: dict[str, float | None] = {"sft": None}
    budgets: dict[str, int] = {}
    for method in args.methods:
        stage, extra = METHODS[method]
        getattr(config, stage).overrides.extend(extra)
        stage_config, _ = pipeline.load_stage_config(stage)
        for item in extra:  # load_stage_config has the overrides; leave the pipeline's section as it was
            getattr(config, stage).overrides.remove(item)
        stage_config.run.out_dir, stage_config.run.name = str(out), method
        stage_named(stage).training_section(stage_config).checkpoint.resume = "none"
        budgets[method] = apply_budget(stage, stage_config, args.samples)
        print(f"\n=== {method}: {budgets[method]} responses ===", flush=True)
        start = time.perf_counter()
        stage_named(stage).run(stage_config)
        seconds[method] = round(time.perf_counter() - start, 1)
        results[method] = evaluate_stage(config.report, method, out / method / "final", prompts, tokenizer, sft)
    compare_with(results, "sft", "vs_sft")

    k = config.report.pass_k
    table = "\n".join(comparison_lines(results, seconds, k))
    print(f"\n{len(prompts)} held-out prompts; budget {args.samples} responses per method ({budgets})\n\n{table}")
    summary = {
        "samples": args.samples, "budgets": budgets, "heldout_prompts": len(prompts), "seconds": seconds,
        "methods": {name: without_per_prompt(result) for name, result in results.items()},
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "alignment_compare.json", json.dumps(json_safe(summary), indent=2) + "\n", what="results")
    write_atomically(out / "alignment_compare.md", table + "\n", what="results table")
    plot(results, out / "alignment_compare.png")
    print(f"\nwrote {out / 'alignment_compare.json'}, {out / 'alignment_compare.md'}, {out / 'alignment_compare.png'}")


if __name__ == "__main__":
    main()
