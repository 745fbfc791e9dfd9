"""GRPO's settings on SmolLM2-135M-Instruct, each scored against the preset's SFT control on the same 600 held-out
questions: what was tried for the goal "GRPO over clean supervision by 2 SE" (docs/results.md).

    lantern pipeline configs/pipeline/smollm2.yaml     # first: the preset trains the SFT control once
    python -m benchmarks.smollm2_sweep [--settings lr_4e-4,group_16] [--seeds 0,1]

Each setting and seed runs the preset with ``stages: [sft, grpo]`` and the setting's GRPO overrides in the preset's
own folder, so the SFT control is up to date (not retrained), the report's scores of the start model and the control
come from its cache, and only GRPO trains (about 10 minutes on 2 CPU cores) and is scored. Each run replaces the
folder's ``grpo/`` (the last one stays; rerun the preset to get its own back). Results go to
``benchmarks/results/smollm2_sweep.json`` after every run, so a sweep stopped halfway keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from data.demo.scoring import score_example
from models.files.atomic import write_atomically
from trainer.plots import read_csv_rows

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "pipeline" / "smollm2.yaml"
CHECKER = "data.demo.scoring:score_example"
NUMBER = re.compile(r"-?\d[\d,]*")

# name: (what it changes, GRPO overrides on top of configs/grpo/smollm2.yaml)
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "preset": ("the preset: lr 2e-4, 4 questions x 8 samples, 40 steps, KL 0.04, the checker alone", []),
    "lr_4e-4": ("lr 4e-4 (twice the preset's)", ["optim.lr=4.0e-4", "optim.min_lr=4.0e-4"]),
    "lr_1e-4": ("lr 1e-4 (half the preset's)", ["optim.lr=1.0e-4", "optim.min_lr=1.0e-4"]),
    "group_16": (
        "group size 16: 2 questions x 16 samples a rollout (the same 32 samples a step)",
        ["grpo.group_size=16", "grpo.prompts_per_rollout=2"],
    ),
    "kl_0": ("no KL penalty (kl_coef 0)", ["grpo.kl_coef=0.0"]),
    "near_miss": (
        "reward shaping: + 0.5 x closeness of the last number to the answer (1 - relative error)",
        [
            f'reward.terms=[{{kind: checker, path: "{CHECKER}", weight: 1.0}}, '
            '{kind: checker, path: "benchmarks.smollm2_sweep:near_miss", weight: 0.5}]'
        ],
    ),
    "steps_60": ("60 optimizer steps (the control has 40)", ["trainer.max_steps=60"]),
}


def near_miss(record: dict[str, Any], response: str) -> float | None:
    """How close the reply's last number is to the answer, 1 - relative error, floored at 0 (1.0 when right).

    Shaping for GRPO: a group whose samples are all wrong has equal checker rewards and so no advantage and no
    gradient; closeness breaks the tie in favour of the nearer miss (81 * 9 = 779 over "81 * 9 = 100")."""
    if score_example(record, response) is None:
        return None
    numbers = NUMBER.findall(response)  # the checker's reading of a reply (data/demo/scoring.py)
    answer = float(record["meta"]["answer"])
    if not numbers or answer == 0:
        return 0.0
    return max(0.0, 1.0 - abs(float(numbers[-1].replace(",", "")) - answer) / abs(answer))


def grpo_overrides(name: str, seed: int) -> list[str]:
    """The GRPO stage's overrides for setting ``name`` run with ``seed``."""
    return [*SETTINGS[name][1], f"run.seed={seed}"]


def run_setting(name: str, seed: int, out_dir: str | None) -> dict[str, Any]:
    """Run the preset's GRPO with ``name``'s overrides and ``seed``; its report's GRPO row and the wall time."""
    config = OmegaConf.load(PRESET)
    config.stages = ["sft", "grpo"]
    config.grpo.overrides = grpo_overrides(name, seed)
    if out_dir:
        config.out_dir = out_dir
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "smollm2-sweep.yaml"
        OmegaConf.save(config, path)
        start = time.perf_counter()
        command = [sys.executable, "-m", "alignment.commands.cli", "pipeline", str(path)]
        subprocess.run(command, cwd=ROOT, env=env, check=True)  # streams the pipeline's own progress
        wall = time.perf_counter() - start
    return grpo_row(ROOT / config.out_dir, name, seed, wall)


# per-step figures of the GRPO run, averaged over its steps after the first: why a setting did what it did
DIAGNOSTICS = ("zero_variance_groups", "solved_groups", "response_length", "step_time", "generation_time")


def training_diagnostics(stage_dir: Path) -> dict[str, float]:
    """Each of ``DIAGNOSTICS`` from the stage's Lightning CSV log, its mean over steps 2..end, and the training
    reward over the last 10 steps."""
    rows = read_csv_rows(stage_dir / "csv" / "metrics.csv")
    series = {
        name: [float(r[f"grpo/{name}"]) for r in rows if r.get(f"grpo/{name}")] for name in (*DIAGNOSTICS, "score")
    }
    means = {name: statistics.mean(values[1:]) for name, values in series.items() if len(values) > 1}
    return {
        **{name: means[name] for name in DIAGNOSTICS if name in means},
        "last_10_score": statistics.mean(series["score"][-10:]),
    }


def grpo_row(pipeline_dir: Path, name: str, seed: int, wall: float) -> dict[str, Any]:
    """The GRPO row of a pipeline run (its report.json and grpo/ log) with setting ``name`` and ``seed``."""
    report = json.loads((pipeline_dir / "report.json").read_text())["stages"]
    grpo = report["grpo"]
    keep = ("heldout", "sampled", "vs_sft", "vs_sft_sampled", "vs_base", "kl", "seconds")
    return {
        "setting": name,
        "seed": seed,
        "what": SETTINGS[name][0],
        "overrides": grpo_overrides(name, seed),
        **{key: grpo.get(key) for key in keep},
        "training": training_diagnostics(pipeline_dir / "grpo"),
        "control": report["sft"]["heldout"],
        "wall_seconds": round(wall, 1),
    }


def summarize(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: each seed's margin over the control, their mean and spread."""
    rows = []
    for name in SETTINGS:
        margins = [r["vs_sft"]["difference"] for r in runs.values() if r["setting"] == name]
        if margins:
            spread = statistics.stdev(margins) if len(margins) > 1 else None  # JSON has no NaN
            rows.append({"setting": name, "seeds": len(margins), "mean_margin": statistics.mean(margins), "sd": spread})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--seeds", default="0", help="GRPO's run.seed values, comma-separated")
    parser.add_argument("--out-dir", default=None, help="the pipeline folder (default: the preset's)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "smollm2_sweep.json"))
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; known: {', '.join(SETTINGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {"runs": {}}
    for name in names:
        for seed in seeds:
            print(f"== {name}, seed {seed}: {SETTINGS[name][0]}", flush=True)
            results["runs"][f"{name}/seed{seed}"] = run_setting(name, seed, args.out_dir)
            results["summary"] = summarize(results["runs"])
            write_atomically(out, json.dumps(results, indent=1) + "\n", what="sweep results")
    print(
        f"{'setting':<12} {'seed':>4} {'greedy':>14} {'vs control':>22} {'add':>6} {'multiply':>8} {'KL':>5} {'s':>5}"
    )
    for r in results["runs"].values():
        m, t = r["vs_sft"], r["heldout"]["per_task"]
        margin = f"{m['difference']:+.3f} ± {m['se']:.3f} ({m['difference'] / m['se']:.1f})"
        print(
            f"{r['setting']:<12} {r['seed']:>4} {r['heldout']['accuracy']:>6.3f} ± {r['heldout']['se']:.3f} "
            f"{margin:>22} {t['add']['accuracy']:>6.3f} {t['multiply']['accuracy']:>8.3f} {r['kl']:>5.2f} "
            f"{r['seconds']:>5.0f}"
        )


if __name__ == "__main__":
    main()
