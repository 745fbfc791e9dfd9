"""The plan tables of docs/plan.md, made by ``lantern plan`` itself: the shipped Llama 3.2 1B, 3.1 8B and 3.1 70B
model presets pretrained with the shipped 8-GPU recipe (``configs/pretrain/llama3.2-1b.yaml``: FSDP2, bf16-mixed,
full activation checkpointing, compiled, 4 x 8192 tokens per GPU, 4 micro-batches a step) on 1, 8 and 64 GPUs (8 a
node), only ``model``, ``trainer.devices`` and ``trainer.num_nodes`` changed. Estimates, not measurements.

    python -m benchmarks.plan_tables [--gpu h100] [--full llama3.1-8b:8]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

from alignment.commands.cli import main as lantern

CONFIG = "configs/pretrain/llama3.2-1b.yaml"
MODELS = ("llama3.2-1b", "llama3.1-8b", "llama3.1-70b")
GPU_COUNTS = (1, 8, 64)


def overrides(model: str, gpus: int) -> list[str]:
    devices, nodes = (gpus, 1) if gpus <= 8 else (8, gpus // 8)
    return [f"model={model}", f"trainer.devices={devices}", f"trainer.num_nodes={nodes}"]


def plan_output(*args: str) -> str:
    """What ``lantern plan ARGS`` prints, run in this process (no CLI start-up per plan); a failure ends the script."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = lantern(["plan", *args])
    if status:
        raise SystemExit(f"lantern plan {' '.join(args)} failed with status {status}")
    return out.getvalue()


def run(*args: str) -> str:
    return plan_output(CONFIG, *args)


def grid(gpu: str) -> str:
    rows = [
        "| model | GPUs | peak GiB per GPU | verdict | step | tokens/s | 100k steps | GPU-hours | what makes it fit |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for model in MODELS:
        for gpus in GPU_COUNTS:
            plan = json.loads(run(*overrides(model, gpus), "--gpu", gpu, "--json"))
            time = plan["time"]
            knob = plan["knob"].replace("|", "/") or "–"
            rows.append(
                f"| {model} | {gpus} | {plan['peak_gib']:.1f} | {plan['verdict']} | {time['step_s']:.2f} s | "
                f"{time['tokens_per_s']:,.0f} | {time['total_s'] / 86400:.1f} days | {time['gpu_hours']:,.0f} | {knob} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="h100", help="the GPU to plan for (default h100)")
    parser.add_argument("--full", default="llama3.1-8b:8", help="MODEL:GPUS whose whole table is printed too")
    args = parser.parse_args(argv)
    print(grid(args.gpu))
    model, _, gpus = args.full.partition(":")
    print(f"\n```\n$ lantern plan {CONFIG} {' '.join(overrides(model, int(gpus)))} --gpu {args.gpu}")
    print(run(*overrides(model, int(gpus)), "--gpu", args.gpu).rstrip() + "\n```")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
