"""Issue 51's proof: does GRPO teach SmolLM2-135M-Instruct to use a calculator on held-out multiplication?

``lantern pipeline configs/pipeline/smollm2-tools.yaml`` trains the tool arms and scores them in greedy episodes with
the calculator; this script runs it, adds the controls without the tool, and compares every arm on the same held-out
questions (2-digit times 1-digit, never trained on), paired:

    base          the instruct model, single turn, no tool
    base+tool     the instruct model with the calculator offered (the pipeline's base)
    tool-SFT      a short LoRA SFT on demonstrations that call the calculator, with the tool (the pipeline's SFT)
    GRPO          GRPO (LoRA) from the instruct model, single turn, no tool: the preset's GRPO settings, no episodes
    GRPO+tool     GRPO (LoRA) from tool-SFT over episodes with the calculator (the pipeline's GRPO)

It prints accuracy ± SE, tool calls per episode, and the paired differences the issue asks for (GRPO+tool against
GRPO and against tool-SFT, each a gain only beyond 2 SE), and writes them to OUT/results.json. Stages run as
``lantern`` commands in child processes; the model is converted once into OUT (or given with --model).

    python -m benchmarks.tool_grpo_experiment --out runs/bench/tool-grpo [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESET = ROOT / "configs" / "pipeline" / "smollm2-tools.yaml"
QUICK = ["demo.n_val=16", "sft.trainer.max_steps=2", "grpo.trainer.max_steps=2", "grpo.eval.every_n_rollouts=2"]


def lantern(*args: str, final: Path | None = None) -> None:
    """``lantern ARGS`` in a child process (as a user runs it), unless ``final`` (its run's final model) is there
    from an earlier run of this script; fails loudly."""
    if final is not None and final.is_dir():
        print(f"  lantern {args[0]}: {final} is there, not run again", flush=True)
        return
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "alignment.commands.cli", *args], cwd=ROOT, check=True)
    print(f"  lantern {args[0]}: {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/tool-grpo"))
    parser.add_argument("--model", type=Path, help="a converted SmolLM2-135M-Instruct folder (default: convert)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 questions, 2 steps a stage")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    from omegaconf import OmegaConf

    from alignment.commands.pipeline import Pipeline, load_pipeline_config
    from alignment.commands.pipeline_eval import evaluate_stage, heldout_prompts
    from alignment.shared.evaluation import mean_and_se, paired_difference, verdict
    from data.tokenizer.tokenizer import Tokenizer

    model = args.model.resolve() if args.model else out / "smollm2-135m-instruct"
    if not model.is_dir():
        lantern("convert", "--from", "gguf", str(GGUF), "--to", "native", str(model))
    overrides = [f"out_dir={out / 'pipeline'}", f"start_checkpoint={model}", *(QUICK if args.quick else [])]
    print("the tool arms: lantern pipeline configs/pipeline/smollm2-tools.yaml", flush=True)
    lantern("pipeline", str(PRESET), *overrides)
    pipeline = Pipeline(load_pipeline_config(str(PRESET), overrides))

    print("GRPO without the tool: the preset's GRPO, single turn, from the instruct model", flush=True)
    grpo = OmegaConf.load(PRESET).grpo
    settings = [o for o in grpo.overrides if not o.startswith("episodes.")]
    settings += [o.partition(".")[2] for o in overrides if o.startswith("grpo.")]
    demo = pipeline.demo
    lantern(
        "grpo", grpo.config, f"init.policy={model}", f"run.out_dir={out}", "run.name=grpo-no-tool", *settings,
        f"data.train=[{demo / 'train_prompts.jsonl'}]", f"data.val=[{demo / 'prompts.jsonl'}]", "logger.kind=csv",
        final=out / "grpo-no-tool" / "final",
    )  # fmt: skip

    # the arms without the tool: scored by the report's own evaluation, its episodes off, on its prompts
    report = pipeline.config.report
    report.episodes.environment = ""
    tokenizer = Tokenizer.load(str(model))
    prompts = heldout_prompts(demo, report, tokenizer)
    scored = {
        "base": evaluate_stage(report, "pretrain", model, prompts, tokenizer, None, sampled=False),
        "GRPO": evaluate_stage(report, "grpo", out / "grpo-no-tool" / "final", prompts, tokenizer, None),
    }
    for name, stage in (("base+tool", "pretrain"), ("tool-SFT", "sft"), ("GRPO+tool", "grpo")):
        scored[name] = json.loads((out / "pipeline" / "report" / f"eval-{stage}.json").read_text())["result"]
    results: dict[str, Any] = {"heldout": len(prompts), "preset": str(PRESET.relative_to(ROOT)), "quick": args.quick}
    for name in ("base", "base+tool", "tool-SFT", "GRPO", "GRPO+tool"):
        mean, se = mean_and_se(scored[name]["scores"])
        episodes = scored[name].get("episodes")
        results[name] = {"accuracy": mean, "se": se, "scores": scored[name]["scores"], **(episodes or {})}
        calls = f", {episodes['tool_calls']:.2f} tool calls / episode" if episodes else ""
        print(f"{name:10s} {mean:.3f} ± {se:.3f}{calls}", flush=True)
    for other in ("GRPO", "tool-SFT", "base+tool"):
        difference, se, n = paired_difference(results["GRPO+tool"]["scores"], results[other]["scores"])
        results[f"GRPO+tool - {other}"] = {
            "difference": difference,
            "se": se,
            "n": n,
            "verdict": verdict(difference, se),
        }
        print(f"GRPO+tool - {other}: {difference:+.3f} ± {se:.3f} (paired, n={n}): {verdict(difference, se)}")
    results["seconds"] = time.perf_counter() - started
    print(f"all: {results['seconds'] / 60:.1f} min")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
