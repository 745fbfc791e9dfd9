"""The effect behind short-answer upsampling, measured on the demo data: same base model, same steps.

    (a) unpacked rows, token-averaged loss      (b) packed rows, token-averaged loss
    (c) packed + short-answer upsampling        (d) packed rows, per-example loss

For each base model (--base, one or more) and each seed (--seeds), every variant fine-tunes the base on demo
data written with that seed (train and held-out examples; the held-out speeches are the same for every seed)
with run.seed = data.seed = that seed, and is scored by the exact-match accuracy of greedy answers on every
held-out short-answer example (the demo's short-answer tasks: --n-val held-out examples, 30% of them short;
long answers are not generated, which saves most of the validation time). Printed per base: each
variant's short-answer accuracy as mean ± standard error over seeds (and per seed), the binomial SE of one
run's figure, held-out loss on short and long answers, supervised tokens/s and packing efficiency; then the
paired differences that matter, (b)−(a) (does packing hurt), (c)−(b) and (d)−(b) (do the fixes help), as
mean ± SE over seeds of the per-seed differences, called a gain or a loss only beyond 2 SE. With few seeds
the SE is itself rough (3 seeds: 2 degrees of freedom), so read the verdicts with the per-seed signs.

Written to --out: results.json (every run and every summary), results.md (the tables) and short_accuracy.png
(mean ± SE per variant and base). A finished run is reused when the command is repeated with the same
settings (its result.json), so an interrupted experiment resumes where it stopped.

    python -m benchmarks.sft_experiment --base runs/shakespeare/final [OTHER_BASE ...] --seeds 0 1 2 --steps 120
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import lightning as L
import torch

from alignment.schemas.sft import SFTConfig
from alignment.stages.sft import run_sft
from data.demo.tasks import write_demo_dataset
from models.loss import IGNORE_INDEX
from trainer.config import load_config
from trainer.plots import read_metrics_csv

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "a": ("unpacked, token loss", ["data.packing=false", "loss.reduction=token"]),
    "b": ("packed, token loss", ["data.packing=true", "loss.reduction=token"]),
    "c": ("packed + upsampling", ["data.packing=true", "loss.reduction=token", "data.short_answer_factor={factor}"]),
    "d": ("packed, example loss", ["data.packing=true", "loss.reduction=example"]),
}
# (later, earlier, what the difference asks)
DIFFERENCES = (("b", "a", "packing: (b) − (a)"), ("c", "b", "upsampling: (c) − (b)"), ("d", "b", "example loss: (d) − (b)"))  # fmt: skip


class StepTimer(L.Callback):
    """Training-step wall time and supervised tokens (validation and the first ``warmup`` steps excluded)."""

    def __init__(self, warmup: int = 3) -> None:
        self.seconds, self.supervised, self.rows, self._start = 0.0, 0, 0, 0.0
        self.warmup = warmup

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step <= self.warmup:
            return
        self.seconds += time.perf_counter() - self._start
        self.supervised += int((batch["targets"] != IGNORE_INDEX).sum())
        self.rows += batch["targets"].shape[0]


def last(path: Path, metric: str) -> float:
    points = read_metrics_csv(path).get(metric)
    return points[-1][1] if points else float("nan")


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample SD / sqrt(n)); the SE is nan below two values."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def verdict(mean: float, se: float) -> str:
    if math.isnan(se):
        return "one seed: no SE"
    if abs(mean) > 2 * se:
        return "gain" if mean > 0 else "loss"
    return "no clear difference"


def demo_data(root: Path, seed: int, n_val: int) -> tuple[dict[str, Path], Path, int]:
    """The demo data of one seed, plus its val file with the short-answer examples first: generating answers
    to only those (eval.generations = their number) scores every short one and skips the costly long ones."""
    paths = write_demo_dataset(root / f"seed{seed}-val{n_val}", n_val=n_val, seed=seed)
    rows = paths["val"].read_text(encoding="utf-8").splitlines()
    short = [r for r in rows if json.loads(r)["kind"] == "short"]
    ordered = paths["val"].with_name("val_short_first.jsonl")
    text = "".join(r + "\n" for r in short + [r for r in rows if json.loads(r)["kind"] != "short"])
    if not ordered.exists() or ordered.read_text(encoding="utf-8") != text:
        ordered.write_text(text, encoding="utf-8")
    return paths, ordered, len(short)


def run_variant(args: argparse.Namespace, base: str, run_dir: Path, seed: int, key: str) -> dict:
    paths, val, n_short = demo_data(Path(args.demo), seed, args.n_val)
    settings = {"base": str(Path(base).resolve()), "seed": seed, "steps": args.steps, "factor": args.factor,
                "precision": args.precision, "n_val": args.n_val, "override": args.override}  # fmt: skip
    cached = run_dir / "result.json"
    if cached.exists() and json.loads(cached.read_text()).get("settings") == settings:
        print(f"--- ({key}) {VARIANTS[key][0]}: reusing {cached}", flush=True)
        return json.loads(cached.read_text())
    name, overrides = VARIANTS[key]
    timer = StepTimer()
    config = load_config(
        SFTConfig,
        ROOT / "configs/sft/shakespeare.yaml",
        [
            f"init.checkpoint={base}", f"data.train=[{paths['train']}]", f"data.val=[{val}]",
            f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}", f"run.seed={seed}", f"data.seed={seed}",
            "logger.kind=csv", "checkpoint.resume=none", f"trainer.max_steps={args.steps}",
            f"trainer.val_every_n_steps={args.steps}", f"trainer.precision={args.precision}",
            f"eval.generations={n_short}", "checkpoint.every_n_steps=100000",
            *[o.format(factor=args.factor) for o in overrides], *args.override,
        ],
    )  # fmt: skip
    print(f"--- ({key}) {name}: seed {seed}, {run_dir}", flush=True)
    start = time.perf_counter()
    run_sft(config, extra_callbacks=[timer])
    stats = json.loads((run_dir / "data_stats.json").read_text())
    if not math.isnan(last(run_dir / "accuracy.csv", "val/accuracy_long")):  # then some had > 3 answer tokens
        raise SystemExit(f"{run_dir}: a demo short-answer example is long by tokens; accuracy_short is not theirs")
    upsampling = stats["train"]["upsampling"]
    result = {
        "settings": settings,
        "short_accuracy": last(run_dir / "accuracy.csv", "val/accuracy_short"),
        "n_short": n_short,
        "val_short_by_tokens": stats["val"]["short"],  # may include a long-task example with a 1-2 token answer
        "long_loss": last(run_dir / "metrics.csv", "val/loss_long"),
        "short_loss": last(run_dir / "metrics.csv", "val/loss_short"),
        "supervised_tokens_per_s": timer.supervised / timer.seconds,
        "rows_per_s": timer.rows / timer.seconds,
        "packing_efficiency": stats["train"]["packing_efficiency"],
        "short_share": upsampling["short_after"] / upsampling["examples_after"],
        "wall_s": time.perf_counter() - start,
    }
    cached.write_text(json.dumps(result, indent=2))
    return result


def summarise(runs: dict[int, dict[str, dict]], variants: str) -> dict:
    """Per variant: mean ± SE over seeds of each measure; per difference: mean ± SE of the per-seed ones."""
    seeds = sorted(runs)
    summary: dict = {"variants": {}, "differences": {}}
    for key in variants:
        entry: dict = {"variant": f"({key}) {VARIANTS[key][0]}"}
        for measure in ("short_accuracy", "long_loss", "short_loss", "supervised_tokens_per_s", "packing_efficiency"):
            values = [runs[s][key][measure] for s in seeds]
            entry[measure] = {"mean": mean_se(values)[0], "se": mean_se(values)[1], "per_seed": values}
        p, n = entry["short_accuracy"]["mean"], runs[seeds[0]][key]["n_short"]
        entry["binomial_se_one_run"] = math.sqrt(p * (1 - p) / n)
        summary["variants"][key] = entry
    for later, earlier, label in DIFFERENCES:
        if later in variants and earlier in variants:
            values = [runs[s][later]["short_accuracy"] - runs[s][earlier]["short_accuracy"] for s in seeds]
            mean, se = mean_se(values)
            same_sign = sum((v > 0) == (mean > 0) and v != 0 for v in values)
            summary["differences"][f"{later}-{earlier}"] = {
                "label": label, "mean": mean, "se": se, "per_seed": values, "verdict": verdict(mean, se),
                "seeds_with_sign_of_mean": same_sign,
            }  # fmt: skip
    return summary


def render(label: str, base: str, summary: dict, args: argparse.Namespace, n_short: int) -> str:
    def pm(entry: dict, digits: int = 3) -> str:
        se = "–" if math.isnan(entry["se"]) else f"{entry['se']:.{digits}f}"
        return f"{entry['mean']:.{digits}f} ± {se}"

    seeds = " ".join(map(str, args.seeds))
    lines = [
        f"## base `{label}` ({base}): {args.steps} steps, {args.precision}, seeds {seeds}, "
        f"{n_short} held-out short-answer examples per seed, {torch.get_num_threads()} CPU thread(s)",
        "",
        "| variant | short-answer accuracy, mean ± SE | per seed | binomial SE of one run | long-answer val loss "
        "| short-answer val loss | supervised tokens/s | packing efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in summary["variants"].values():
        acc = entry["short_accuracy"]
        lines.append(
            f"| {entry['variant']} | {pm(acc)} | {' '.join(f'{v:.3f}' for v in acc['per_seed'])} | "
            f"{entry['binomial_se_one_run']:.3f} | {pm(entry['long_loss'])} | {pm(entry['short_loss'])} | "
            f"{entry['supervised_tokens_per_s']['mean']:.0f} | {entry['packing_efficiency']['mean']:.3f} |"
        )
    if summary["differences"]:
        lines += ["", "| paired difference in short-answer accuracy | mean ± SE | per seed | seeds with that sign | verdict (2 SE) |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for d in summary["differences"].values():
            lines.append(
                f"| {d['label']} | {pm(d)} | {' '.join(f'{v:+.3f}' for v in d['per_seed'])} | "
                f"{d['seeds_with_sign_of_mean']}/{len(d['per_seed'])} | {d['verdict']} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Grouped bars: short-answer accuracy per variant, one colour per base, error bars ± 1 SE over seeds."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI (as trainer/plots.py)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    labels = list(results)
    width = 0.8 / max(1, len(labels))
    for index, label in enumerate(labels):
        entries = list(results[label]["summary"]["variants"].values())
        means = [e["short_accuracy"]["mean"] for e in entries]
        errors = [0.0 if math.isnan(e["short_accuracy"]["se"]) else e["short_accuracy"]["se"] for e in entries]
        positions = [i + (index - (len(labels) - 1) / 2) * width for i in range(len(entries))]
        axes.bar(positions, means, width, yerr=errors, capsize=3, label=label)
    axes.set_xticks(range(len(entries)), [e["variant"].replace(", ", ",\n", 1) for e in entries], fontsize=8)
    axes.set_ylabel("short-answer accuracy (mean ± SE)")
    axes.set_title(f"SFT variants, seeds {' '.join(map(str, next(iter(results.values()))['seeds']))}")
    axes.grid(axis="y", alpha=0.3)
    axes.legend(title="base")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


def base_labels(bases: list[str], given: list[str] | None) -> list[str]:
    if given:
        if len(given) != len(bases):
            raise SystemExit(f"--labels: {len(given)} labels for {len(bases)} bases")
        return given
    labels = []
    for index, base in enumerate(bases):  # runs/shakespeare/final -> shakespeare
        path = Path(base)
        label = path.parent.name if path.name == "final" else path.name
        labels.append(label if label not in labels else f"{label}-{index}")
    return labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", nargs="+", default=["runs/shakespeare/final"], help="pretrained model folder(s)")
    parser.add_argument("--labels", nargs="+", help="a short name per base (default: the folder's name)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="demo data, run and data seeds")
    parser.add_argument("--demo", default="runs/data/sft-experiment", help="demo data go to DEMO/seedS-valN")
    parser.add_argument("--n-val", type=int, default=1200, help="held-out demo examples per seed (30%% short)")
    parser.add_argument("--out", default="runs/sft-experiment")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--factor", type=int, default=4, help="short-answer copies in variant (c)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--variants", default="abcd")
    parser.add_argument("--override", action="append", default=[], help="extra key=value for every variant")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))  # OMP_NUM_THREADS, when set, decides

    out = Path(args.out)
    started = time.perf_counter()
    results: dict = {}
    for label, base in zip(base_labels(args.base, args.labels), args.base):
        runs = {
            seed: {key: run_variant(args, base, out / label / f"seed{seed}" / key, seed, key) for key in args.variants}
            for seed in args.seeds
        }
        n_short = runs[args.seeds[0]][args.variants[0]]["n_short"]
        summary = summarise(runs, args.variants)
        results[label] = {"base": base, "seeds": args.seeds, "n_short": n_short, "runs": runs, "summary": summary}
        results[label]["table"] = render(label, base, summary, args, n_short)
    command = "python -m benchmarks.sft_experiment " + " ".join(
        [f"--base {' '.join(args.base)}", f"--seeds {' '.join(map(str, args.seeds))}", f"--steps {args.steps}",
         f"--n-val {args.n_val}", f"--precision {args.precision}", f"--factor {args.factor}"]
    )  # fmt: skip
    text = "\n\n".join(r["table"] for r in results.values())
    run_s = sum(r["wall_s"] for entry in results.values() for seed in entry["runs"].values() for r in seed.values())
    print(f"\n{text}\n\nthis command {time.perf_counter() - started:.0f} s; the runs' own wall time {run_s:.0f} s")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(f"{command}\n\n{text}\n")
    settings = {**vars(args), "threads": torch.get_num_threads(), "command": command}
    (out / "results.json").write_text(json.dumps({"settings": settings, "bases": results}, indent=2))
    plot(results, out / "short_accuracy.png")


if __name__ == "__main__":
    main()
