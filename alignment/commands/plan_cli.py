"""The arguments of ``lantern plan``: only parsing here (no torch), so that ``lantern --help`` stays light."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from trainer.hardware import FABRICS, GPUS


def add_plan_command(commands: Any, handler: Callable[[argparse.Namespace], None]) -> None:
    """``lantern plan CONFIG [key=value ...] [--gpu NAME] [--json]`` and its other flags, on ``commands``."""
    plan = commands.add_parser("plan", help="will a stage or pipeline fit, how fast, at what cost: before renting GPUs")
    plan.add_argument("config", help="a stage's or a pipeline's YAML config")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.devices=8")
    plan.add_argument("--gpu", help=f"the GPU to plan for: {', '.join(GPUS)}, or cpu (default: h100)")
    plan.add_argument("--json", action="store_true", help="the whole plan as JSON")
    plan.add_argument("--stage", help="the stage CONFIG is for, when neither its folder nor its keys say")
    plan.add_argument("--model", help="the model to plan: a preset, a model YAML or a checkpoint folder")
    plan.add_argument("--mfu", type=float, help="model FLOPs utilisation to plan at (default: the table's figure)")
    plan.add_argument("--fabric", help=f"the interconnect between nodes: {', '.join(FABRICS)}")
    plan.add_argument("--bandwidth", type=float, help="achieved collective bandwidth per GPU, GB/s (not --fabric)")
    plan.add_argument("--price-per-gpu-hour", type=float, help="price of one GPU-hour, for the cost")
    plan.add_argument(
        "--mean-response-tokens", type=float,
        help="RL and rejection sampling: the mean tokens a response runs to (a run's response_length); a row leaves "
        "the batch when it stops, so it costs decoding that long (default: every row to response_max_tokens)",
    )  # fmt: skip
    numbers = "a GPU no name fits (with --gpu: that GPU, changed)"
    plan.add_argument("--gpu-memory-gib", type=float, help=f"{numbers}: its memory as nvidia-smi reports it, GiB")
    plan.add_argument("--gpu-bf16-tflops", type=float, help=f"{numbers}: its dense bf16 tensor-core peak, TFLOP/s")
    plan.add_argument("--gpu-bandwidth", type=float, help=f"{numbers}: its memory bandwidth, TB/s")
    plan.set_defaults(handler=handler)
