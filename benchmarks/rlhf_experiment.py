"""Proof that RLHF works here, on the verifiable demo tasks: train the reward model on preference pairs
whose preferred side is the correct answer, report its held-out pairwise accuracy; run PPO from the SFT model
against it and report the ground-truth score (the task checkers in data/demo/scoring.py, which PPO never sees)
of greedy answers to held-out prompts before and after, with the final KL to the SFT reference.

    python -m benchmarks.rlhf_experiment --sft runs/sft-shakespeare/final [--rm-steps 200 --ppo-rollouts 40]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from alignment.schemas.reward import RMConfig
from alignment.schemas.rl import PPOConfig
from alignment.stages.ppo import run_ppo
from alignment.stages.reward import run_rm
from data.demo.tasks import write_demo_dataset
from trainer.config import load_config
from trainer.plots import read_csv_rows, read_metrics_csv

ROOT = Path(__file__).resolve().parents[1]


def series(path: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of a metric from a LossPlot CSV (metric,step,value) or a Lightning CSV log."""
    points = read_metrics_csv(path)
    if points:
        return points.get(metric, [])
    return [(int(r["step"]), float(r[metric])) for r in read_csv_rows(path) if r.get(metric) not in (None, "")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default="runs/sft-shakespeare/final")
    parser.add_argument("--demo", default="runs/data/demo")
    parser.add_argument("--out", default="runs/rlhf-experiment")
    parser.add_argument("--rm-steps", type=int, default=200)
    parser.add_argument("--ppo-rollouts", type=int, default=40)
    parser.add_argument("--rm-override", action="append", default=[])
    parser.add_argument("--ppo-override", action="append", default=[])
    args = parser.parse_args()

    demo = write_demo_dataset(args.demo)
    rm_config = load_config(
        RMConfig,
        ROOT / "configs/rm/shakespeare.yaml",
        [f"init.checkpoint={args.sft}", f"data.train=[{demo['pairs']}]", f"run.out_dir={args.out}", "run.name=rm",
         "logger.kind=csv", "checkpoint.resume=none", f"trainer.max_steps={args.rm_steps}", *args.rm_override],
    )  # fmt: skip
    rm_dir = run_rm(rm_config)
    rm_accuracy = series(rm_dir / "accuracy.csv", "val/accuracy")

    ppo_config = load_config(
        PPOConfig,
        ROOT / "configs/ppo/shakespeare.yaml",
        [f"init.policy={args.sft}", f"init.reward_model={rm_dir / 'final'}", f"data.train=[{demo['prompts']}]",
         f"run.out_dir={args.out}", "run.name=ppo", "logger.kind=csv", "checkpoint.resume=none",
         f"trainer.max_steps={args.ppo_rollouts}", *args.ppo_override],
    )  # fmt: skip
    ppo_dir = run_ppo(ppo_config)
    gt, rm_score = series(ppo_dir / "eval.csv", "eval/gt_score"), series(ppo_dir / "eval.csv", "eval/rm_score")
    kl = series(ppo_dir / "kl.csv", "ppo/kl")
    results = {
        "rm_heldout_accuracy": rm_accuracy[-1][1] if rm_accuracy else None,
        "ground_truth_before": gt[0][1], "ground_truth_after": gt[-1][1],
        "rm_score_before": rm_score[0][1] if rm_score else None, "rm_score_after": rm_score[-1][1] if rm_score else None,
        "final_kl": kl[-1][1], "rollouts": args.ppo_rollouts, "rm_steps": args.rm_steps,
    }  # fmt: skip
    text = "\n".join([
        "| measure | value |", "|---|---|",
        f"| reward model: held-out pairwise accuracy | {results['rm_heldout_accuracy']:.3f} |",
        f"| ground-truth score of greedy answers, SFT (before PPO) | {results['ground_truth_before']:.3f} |",
        f"| ground-truth score of greedy answers, after {args.ppo_rollouts} PPO rollouts | {results['ground_truth_after']:.3f} |",
        f"| reward-model score (normalised), before → after | {results['rm_score_before']:.3f} → {results['rm_score_after']:.3f} |",
        f"| final KL to the SFT reference (nats per response) | {results['final_kl']:.3f} |",
    ])  # fmt: skip
    print(text)
    (Path(args.out) / "results.md").write_text(text + "\n")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
