"""Optimizers and schedules on the bundled corpus: Muon + WSD, AdamW + cosine and AdamW + WSD, each over several seeds
with the same data, model and steps, and a WSD cooldown branched from a stable-phase checkpoint against the run that
had that length from the start (docs/results.md#optimizers-and-schedules).

    lantern prepare configs/pretrain/shakespeare.yaml
    python -m benchmarks.pretrain_recipes [--seeds 0,1,2] [--steps 300] [--val-every 25]

Per recipe: the final validation loss (mean ± SE over seeds) and the optimizer steps each run needs to reach AdamW +
cosine's mean final validation loss (linear between validations; ``null`` when a run never reaches it), as a ratio
to AdamW + cosine's own. The branch: a constant-rate run (WSD's stable phase) to the cooldown's first step, then
``checkpoint.resume`` of its checkpoint into a new run with ``optim.schedule=wsd`` and the full length, against the
seed-0 AdamW + WSD run (and the spread of that run over seeds). A run folder already validated at its last step is
read back rather than retrained, and an interrupted one resumes, so the sweep can be stopped and run again. Every
run is ``lantern pretrain`` in its own process; results go to ``benchmarks/results/pretrain_recipes.json`` after
every run, and the validation curves to ``pretrain_recipes.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from models.files.atomic import write_atomically
from trainer.plots import read_metrics_csv

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BASELINE = "adamw_cosine"
STABLE = "stable"  # the branched cooldown's stable phase, a job of the sweep's pool
# name: overrides on top of the preset (its AdamW lr 2e-3 -> 2e-4, 20 warmup steps); WSD cools down over the last 20%
RECIPES: dict[str, list[str]] = {
    "adamw_cosine": ["optim.name=adamw", "optim.schedule=cosine"],
    "adamw_wsd": ["optim.name=adamw", "optim.schedule=wsd", "optim.decay_fraction=0.2"],
    "muon_wsd": ["optim.name=muon", "optim.schedule=wsd", "optim.decay_fraction=0.2"],
}


def pretrain(preset: str, out_dir: Path, name: str, overrides: list[str], threads: int = 0) -> tuple[Path, float]:
    """One ``lantern pretrain`` in its own process (``threads`` > 0: that many intra-op threads, its output to
    OUT_DIR/NAME.log); (its run folder, wall seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    common = [f"run.out_dir={out_dir}", f"run.name={name}", "logger.kind=csv", "sample.prompt="]
    command = [sys.executable, "-m", "alignment.commands.cli", "pretrain", preset, *common, *overrides]
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{name}.log", "w") if threads else contextlib.nullcontext() as log:
        subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT if log else None)
    return out_dir / name, time.perf_counter() - start


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    return sorted(read_metrics_csv(run_dir / "metrics.csv").get("val/loss", []))


def finished(run_dir: Path, steps: int) -> bool:
    """Whether ``run_dir`` holds a run validated at its last step (a sweep run again reads it instead of retraining;
    an interrupted one is run again, and ``lantern pretrain`` resumes it from its latest checkpoint)."""
    return (run_dir / "metrics.csv").is_file() and any(step == steps for step, _ in val_curve(run_dir))


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which the validation loss is at or below ``target``, linear between validations."""
    for (step0, loss0), (step1, loss1) in zip([(0, math.inf), *curve], curve):
        if loss1 <= target:
            if not math.isfinite(loss0) or loss0 == loss1:
                return float(step1)
            return step0 + (loss0 - target) / (loss0 - loss1) * (step1 - step0)
    return None


def mean_se(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "se": None, "n": 0}
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": statistics.fmean(values), "se": se, "n": len(values)}


def summarise(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Final losses and steps-to-target per recipe, the target being the baseline's mean final loss."""
    finals = {name: [run["final_val_loss"] for run in seeds.values()] for name, seeds in runs.items()}
    if not finals.get(BASELINE):
        return {}
    target = statistics.fmean(finals[BASELINE])
    base_steps = [steps_to_reach(run["curve"], target) for run in runs[BASELINE].values()]
    base = statistics.fmean([s for s in base_steps if s is not None])
    summary: dict[str, Any] = {"target_val_loss": target}
    for name, seeds in runs.items():
        steps = [steps_to_reach(run["curve"], target) for run in seeds.values()]
        reached = [s for s in steps if s is not None]
        summary[name] = {
            "final_val_loss": mean_se(finals[name]),
            "steps_to_target": mean_se(reached),
            "runs_reaching_target": f"{len(reached)} of {len(steps)}",
            "steps_ratio_to_baseline": mean_se([s / base for s in reached]),
        }
    return summary


def decay_steps(steps: int) -> int:
    return max(1, round(0.2 * steps))  # adamw_wsd's decay_fraction 0.2, as trainer.optim_config.decay_length counts it


def stable_overrides(steps: int, seed: int, common: list[str]) -> list[str]:
    """The branch's stable phase: AdamW at a constant rate (WSD's stable phase) up to the cooldown's first step."""
    stable_steps = steps - decay_steps(steps)
    return [*common, f"run.seed={seed}", "optim.name=adamw", "optim.schedule=constant",
            f"trainer.max_steps={stable_steps}", f"checkpoint.every_n_steps={stable_steps}"]  # fmt: skip


def cooldown(preset: str, out_dir: Path, stable: Path, steps: int, seed: int, common: list[str]) -> dict[str, Any]:
    """The cooldown resumed from the stable phase's last checkpoint in a new run (its step count and optimizer
    state continued): its final loss, for comparison with the seed's AdamW + WSD run that had this length throughout."""
    checkpoint = sorted((stable / "checkpoints").glob("*.ckpt"))[-1]
    run_dir, wall = out_dir / f"cooldown_seed{seed}", None
    if not finished(run_dir, steps):
        run_dir, wall = pretrain(preset, out_dir, run_dir.name, [
            *common, f"run.seed={seed}", *RECIPES["adamw_wsd"], f"trainer.max_steps={steps}",
            f"checkpoint.resume={checkpoint}",
        ])  # fmt: skip
    curve = val_curve(run_dir)
    return {"stable_checkpoint": str(checkpoint.relative_to(out_dir)), "cooldown_steps": decay_steps(steps),
            "final_val_loss": curve[-1][1], "cooldown_seconds": None if wall is None else round(wall, 1)}  # fmt: skip


def plot(runs: dict[str, dict[int, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for color, (name, seeds) in zip(("C0", "C1", "C2", "C3"), runs.items()):
        for index, run in enumerate(seeds.values()):
            steps, losses = zip(*run["curve"])
            axis.plot(steps, losses, color=color, alpha=0.7, label=name if index == 0 else None)
    axis.set(xlabel="optimizer step", ylabel="validation loss (nats / token)", title="optimizers and schedules")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="configs/pretrain/shakespeare.yaml")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values")
    parser.add_argument("--steps", type=int, default=300, help="trainer.max_steps of every run")
    parser.add_argument("--val-every", type=int, default=25, help="trainer.val_every_n_steps (the steps' resolution)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"of {', '.join(RECIPES)}")
    parser.add_argument("--no-branch", action="store_true", help="skip the branched cooldown")
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs at once, the cores shared out (tiny models train faster a run on one core each than one run on two)",
    )
    parser.add_argument("--out-dir", default="runs/pretrain-recipes")
    parser.add_argument("--json", default=str(RESULTS / "pretrain_recipes.json"))
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for every run (a smoke test's)")
    args = parser.parse_args(argv)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    names = args.recipes.split(",")
    if unknown := sorted(set(names) - set(RECIPES)):
        parser.error(f"unknown recipes {unknown}; choose from {', '.join(RECIPES)}")
    out_dir, result_path = Path(args.out_dir).absolute(), Path(args.json)
    common = [f"trainer.max_steps={args.steps}", f"trainer.val_every_n_steps={args.val_every}",
              f"checkpoint.every_n_steps={args.steps}", *args.extra]  # fmt: skip
    runs: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    # the wall times of runs read back rather than trained (a resumed one reports its last part only)
    previous = json.loads(result_path.read_text()).get("recipes", {}) if result_path.is_file() else {}
    result: dict[str, Any] = {"preset": args.preset, "steps": args.steps, "seeds": seeds, "recipes": {}}
    jobs = [(seed, name) for seed in seeds for name in names]  # seeds outermost: a sweep stopped early has them all
    threads = max(1, (os.cpu_count() or 1) // args.parallel) if args.parallel > 1 else 0
    result["parallel"] = {"processes": args.parallel, "threads_each": threads or "torch's default"}

    branched = not args.no_branch and "adamw_wsd" in names
    if branched:  # the stable phase trains beside the sweep's runs; its cooldown follows them
        jobs.append((seeds[0], STABLE))

    def one(job: tuple[int, str]) -> tuple[int, str, Path, float | None]:
        seed, name = job
        run_dir = out_dir / f"{name}_seed{seed}"
        last = args.steps - decay_steps(args.steps) if name == STABLE else args.steps
        if finished(run_dir, last):
            return seed, name, run_dir, None
        overrides = (
            stable_overrides(args.steps, seed, common)
            if name == STABLE
            else [*common, f"run.seed={seed}", *RECIPES[name]]
        )
        return (seed, name, *pretrain(args.preset, out_dir, run_dir.name, overrides, threads))

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:  # each job is its own process
        for seed, name, run_dir, wall in pool.map(one, jobs):
            if name == STABLE:
                stable = run_dir
                continue
            curve = val_curve(run_dir)
            seconds = round(wall, 1) if wall is not None else previous.get(name, {}).get(str(seed), {}).get("seconds")
            runs[name][seed] = {"curve": curve, "final_val_loss": curve[-1][1], "seconds": seconds}
            result["recipes"] = {n: {str(s): r for s, r in seeds_.items()} for n, seeds_ in runs.items()}
            result["summary"] = summarise(runs)
            write_atomically(result_path, json.dumps(result, indent=2) + "\n")
    if branched:
        from_start = [run["final_val_loss"] for run in runs["adamw_wsd"].values()]
        result["branch"] = cooldown(args.preset, out_dir, stable, args.steps, seeds[0], common) | {
            "from_the_start_val_loss": runs["adamw_wsd"][seeds[0]]["final_val_loss"],
            "from_the_start_across_seeds": mean_se(from_start),
        }
        write_atomically(result_path, json.dumps(result, indent=2) + "\n")
    plot(runs, result_path.with_suffix(".png"))
    print(json.dumps({"summary": result["summary"], "branch": result.get("branch")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
