"""The effect behind short-answer upsampling, reproduced on the demo data: same base model, same steps.

    (a) unpacked rows, token-averaged loss      (b) packed rows, token-averaged loss
    (c) packed + short-answer upsampling        (d) packed rows, per-example loss

For each: exact-match accuracy of greedy answers on held-out short-answer examples, held-out loss on
long-answer examples, supervised tokens/s and rows' packing efficiency. Packed vs padded throughput is
measured in the same run.

    python -m benchmarks.sft_experiment --base runs/shakespeare/final [--steps 150 --precision 32-true]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning as L
import torch

from alignment.sft import run_sft
from data.demo_tasks import write_demo_dataset
from models.loss import IGNORE_INDEX
from trainer.config import SFTConfig, load_config
from trainer.plots import read_metrics_csv

VARIANTS = {
    "a": ("unpacked, token loss", ["data.packing=false", "loss.reduction=token"]),
    "b": ("packed, token loss", ["data.packing=true", "loss.reduction=token"]),
    "c": ("packed + upsampling", ["data.packing=true", "loss.reduction=token", "data.short_answer_factor={factor}"]),
    "d": ("packed, example loss", ["data.packing=true", "loss.reduction=example"]),
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--base", default="runs/shakespeare/final", help="the pretrained model every variant starts from"
    )
    parser.add_argument("--demo", default="runs/data/demo")
    parser.add_argument("--out", default="runs/sft-experiment")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--factor", type=int, default=4, help="short-answer copies in variant (c)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--variants", default="abcd")
    parser.add_argument("--override", action="append", default=[], help="extra key=value for every variant")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    demo = write_demo_dataset(args.demo)
    results = {}
    for key in args.variants:
        name, overrides = VARIANTS[key]
        timer = StepTimer()
        config = load_config(
            SFTConfig,
            Path(__file__).resolve().parents[1] / "configs/sft/shakespeare.yaml",
            [
                f"init.checkpoint={args.base}", f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]",
                f"run.out_dir={args.out}", f"run.name={key}", "logger.kind=csv", "checkpoint.resume=none",
                f"trainer.max_steps={args.steps}", f"trainer.val_every_n_steps={args.steps}",
                f"trainer.precision={args.precision}", "eval.generations=400", "checkpoint.every_n_steps=100000",
                *[o.format(factor=args.factor) for o in overrides], *args.override,
            ],
        )  # fmt: skip
        print(f"--- ({key}) {name}", flush=True)
        run_dir = run_sft(config, extra_callbacks=[timer])
        stats = json.loads((run_dir / "data_stats.json").read_text())
        results[key] = {
            "variant": f"({key}) {name}",
            "short_accuracy": last(run_dir / "accuracy.csv", "val/accuracy_short"),
            "long_accuracy": last(run_dir / "accuracy.csv", "val/accuracy_long"),
            "long_loss": last(run_dir / "metrics.csv", "val/loss_long"),
            "short_loss": last(run_dir / "metrics.csv", "val/loss_short"),
            "supervised_tokens_per_s": timer.supervised / timer.seconds,
            "rows_per_s": timer.rows / timer.seconds,
            "packing_efficiency": stats["train"]["packing_efficiency"],
            "short_share": stats["train"]["upsampling"]["short_after"] / stats["train"]["upsampling"]["examples_after"],
        }
    table = [
        "| variant | short-answer accuracy | long-answer val loss | short-answer val loss | supervised tokens/s | packing efficiency | short share of examples |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        table.append(
            f"| {r['variant']} | {r['short_accuracy']:.3f} | {r['long_loss']:.3f} | {r['short_loss']:.3f} | "
            f"{r['supervised_tokens_per_s']:.0f} | {r['packing_efficiency']:.3f} | {r['short_share']:.2f} |"
        )
    if "a" in results and "b" in results:
        table.append(
            f"\npacked / padded supervised tokens/s (same run): {results['b']['supervised_tokens_per_s'] / results['a']['supervised_tokens_per_s']:.2f}x"
        )
    text = "\n".join(table)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.md").write_text(
        f"{args.steps} steps from {args.base}, precision {args.precision}\n\n{text}\n"
    )
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
