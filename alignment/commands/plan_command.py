"""``lantern plan CONFIG [key=value ...] [--gpu NAME] [--json]``: will a stage (or each stage of a pipeline) fit, how
fast will it run and what will it cost, before a GPU is rented.

Reads what to plan: the stage (``--stage``, else a pipeline's ``stages``, else the configs/ folder the file sits in,
else the one schema it loads under), its models (their folders' configs, or ``--model``; a pipeline's later stages
take the model of the stage before them) and the target (``--gpu``, ``--mfu``, ``--fabric``, ``--bandwidth``,
``--price-per-gpu-hour``); prints a table, or ``--json``. The plan itself is the stage record's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from omegaconf import DictConfig

from alignment.shared.plan_models import ModelResolver, stage_models
from alignment.shared.stage_plan import StagePlan, Target
from alignment.stages import registry
from alignment.stages.registry import Stage
from models.errors import ConfigError
from models.memory import GiB
from models.model import ModelConfig
from trainer.config import existing_config_file, load_config, read_yaml
from trainer.hardware import fabric_named, gpu_by_numbers, gpu_named
from trainer.plan import duration, gib


def detect_stage(path: str, overrides: list[str], stage: str | None) -> Stage | None:
    """The stage ``path`` configures (None: a pipeline): ``--stage``; a pipeline config (a ``stages`` list); the
    stage folder it sits in (configs/ppo/tiny.yaml); else the one stage schema it loads under."""
    names = f"{', '.join(s.command for s in registry.STAGES)}, pipeline"
    if stage:
        if stage == "pipeline":
            return None
        if registry.find_stage(stage) is None:
            raise ConfigError(f"--stage {stage!r} is not a stage: one of {names}")
        return registry.stage_named(stage)
    file = existing_config_file(path)
    raw = read_yaml(file)  # the loader every command reads a config with: a duplicate key is named, not guessed past
    if (isinstance(raw, DictConfig) and "stages" in raw) or file.resolve().parent.name == "pipeline":
        return None
    folder = registry.find_stage(file.resolve().parent.name)  # configs/ppo/tiny.yaml
    if folder is not None:
        return folder
    loads = [s for s in registry.STAGES if _loads(s, path, overrides)]
    if len(loads) == 1:
        return loads[0]
    named = " or ".join(s.command for s in loads) if loads else "no stage's config"
    raise ConfigError(f"{path} reads as {named}: name the stage with --stage ({names})")


def _loads(stage: Stage, path: str, overrides: list[str]) -> bool:
    try:
        load_config(stage.schema, path, overrides)
    except ConfigError:
        return False
    return True


def target_from(args: argparse.Namespace, accelerator: str = "auto") -> Target:
    """``--gpu`` (default h100; ``cpu``: this machine's CPU against its memory), or a GPU by its numbers, and the
    figures given instead of the tables'."""
    numbers = (args.gpu_memory_gib, args.gpu_bf16_tflops, args.gpu_bandwidth)
    for flag, value in zip(("--gpu-memory-gib", "--gpu-bf16-tflops", "--gpu-bandwidth"), numbers):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    given = any(value is not None for value in numbers)
    name = args.gpu or ("" if given else "cpu" if accelerator == "cpu" else "h100")
    if args.fabric:
        fabric_named(args.fabric)  # an unknown name is one line, before any planning
    if name.strip().lower() == "cpu":
        if given:
            raise ConfigError(
                "--gpu cpu plans against this machine's memory: --gpu-memory-gib and the like are for GPUs"
            )
        gpu = None
    else:
        gpu = gpu_named(name) if name else None
        gpu = gpu_by_numbers(gpu, *numbers) if given else gpu
    positive = (("--mfu", args.mfu), ("--bandwidth", args.bandwidth), ("--mean-response-tokens", args.mean_response_tokens))  # fmt: skip
    for flag, value in positive:
        if value is not None and (value <= 0 or (flag == "--mfu" and value > 1)):
            raise ConfigError(f"{flag} must be {'in (0, 1]' if flag == '--mfu' else '> 0'}, got {value}")
    if args.price_per_gpu_hour is not None and args.price_per_gpu_hour < 0:
        raise ConfigError(f"--price-per-gpu-hour must be >= 0, got {args.price_per_gpu_hour}")
    return Target(gpu, args.mfu, args.fabric, args.bandwidth, args.price_per_gpu_hour, args.mean_response_tokens)


def plan_config(args: argparse.Namespace) -> tuple[list[StagePlan], bool]:
    """The plan of a stage config, or one per model stage of a pipeline config; and whether it was a pipeline."""
    stage = detect_stage(args.config, args.overrides, args.stage)
    if stage is None:
        return plan_pipeline(args), True
    config = load_config(stage.schema, args.config, args.overrides)
    trainer = stage.training_section(config).trainer
    models = stage_models(stage, config, ModelResolver(args.model))
    return [stage.plan(config, models, target_from(args, trainer.accelerator))], False


def plan_pipeline(args: argparse.Namespace) -> list[StagePlan]:
    """Each model stage of a pipeline from its resolved config (``Pipeline.load_stage_config``: the preset, its
    overrides and the wiring), each stage's model the one its upstream stage trains."""
    from alignment.commands.pipeline import Pipeline, load_pipeline_config

    pipeline = Pipeline(load_pipeline_config(args.config, args.overrides))
    pipeline.demo_hash = "plan"  # the demo data is not written to plan: its hash only keys re-runs
    known: dict[str, ModelConfig] = {}
    plans = []
    for name in pipeline.config.stages:
        stage = registry.find_stage(name)
        if stage is None:  # prepare: the data step
            continue
        config, _ = pipeline.load_stage_config(name)
        final = pipeline.stage_dir(name) / "final"
        pipeline.outputs[name] = (final, "plan")  # the next stages are wired to it
        models = stage_models(stage, config, ModelResolver(args.model, known))
        trainer = stage.training_section(config).trainer
        plans.append(stage.plan(config, models, target_from(args, trainer.accelerator)))
        known[str(final)] = models.policy
    return plans


def plan_dict(plan: StagePlan) -> dict[str, Any]:
    """The plan for tools: every item in bytes and GiB, the verdict, the timing with its sources."""
    timing = None
    if plan.timing is not None:
        t = plan.timing
        hours = t.total_s / 3600 * plan.gpus
        timing = {
            **{k: v for k, v in asdict(t).items() if k != "notes"}, "tokens_per_s": t.tokens_per_s,
            "tokens_per_s_per_gpu": t.tokens_per_s / max(plan.gpus, 1), "total_s": t.total_s, "gpu_hours": hours,
            "cost": None if plan.price_per_gpu_hour is None else hours * plan.price_per_gpu_hour, "notes": t.notes,
        }  # fmt: skip
    phases = [
        {"name": phase.name, "moment": phase.moment, "bytes": phase.total, "gib": phase.total / GiB,
         "items": [{"name": i.name, "bytes": i.bytes, "gib": i.bytes / GiB, "note": i.note} for i in phase.items]}
        for phase in plan.phases
    ]  # fmt: skip
    return {
        "stage": plan.stage, "model": plan.model, "parameters": plan.parameters,
        "trainable_parameters": plan.trainable_parameters, "tokens_per_step": plan.tokens_per_step, "run": plan.run,
        "batch": plan.batch, "device": plan.device, "gpus": plan.gpus, "capacity_bytes": plan.capacity,
        "peak_bytes": plan.peak, "peak_gib": plan.peak / GiB,
        "peak_phase": plan.peak_phase.name, "verdict": plan.verdict, "knob": plan.knob, "line": plan.line(),
        "phases": phases, "time": timing, "notes": plan.notes,
        "activations_by_checkpointing": {mode: value / GiB for mode, value in plan.by_checkpointing.items()},
    }  # fmt: skip


def render(plan: StagePlan) -> str:
    """The table: model, run, batch; memory per GPU at the peak phase; time and cost; the verdict."""
    lines = [
        f"lantern plan: {plan.stage}",
        f"  model   {plan.model}",
        f"  run     {plan.run}",
        f"  batch   {plan.batch}",
    ]
    width = max(len(item.name) for phase in plan.phases for item in phase.items) + 2
    for phase in plan.phases:
        peak = " (the peak)" if phase is plan.peak_phase and len(plan.phases) > 1 else ""
        lines += ["", f"memory per {'GPU' if plan.gpus else 'process'}, {phase.name}{peak}{' ' * 4}GiB"]
        for item in phase.items:
            lines.append(f"  {item.name:<{width}}{gib(item.bytes):>8}   {item.note}")
        lines.append(f"  {'total':<{width}}{gib(phase.total):>8}")
    if plan.by_checkpointing:
        modes = ", ".join(f"{mode} {gib(value)}" for mode, value in plan.by_checkpointing.items())
        lines.append(f"  activations at their peak by trainer.activation_checkpointing, GiB: {modes}")
    if plan.timing is not None:
        t = plan.timing
        hours = t.total_s / 3600 * plan.gpus
        cost = (
            f", ${hours * plan.price_per_gpu_hour:,.0f}" if plan.price_per_gpu_hour else " (cost: --price-per-gpu-hour)"
        )
        recompute = (
            f" = {t.mfu_figure:.1%} x {t.mfu / t.mfu_figure:.3g} for this run's recomputation against the figure's"
            if abs(t.mfu / t.mfu_figure - 1) > 1e-9
            else ""
        )
        lines += [
            "", "time",
            f"  FLOPs per token   {t.flops_per_token / 1e9:.3g} GFLOP; {t.tokens_per_step:,} tokens per step",
            f"  MFU               {t.mfu:.1%}{recompute}: {t.mfu_source}",
            f"  step              {duration(t.step_s)} (compute {duration(t.compute_s)}; "
            + (f"communication {duration(t.communication_s)}: {t.communication}" if t.communication else "no collectives")
            + (f"; then AdamW on the host {duration(t.host_s)})" if t.host_s else ")"),
            f"  throughput        {t.tokens_per_s:,.0f} tokens/s ({t.tokens_per_s / max(plan.gpus, 1):,.0f} per GPU)",
            f"  {t.steps:,} steps: {duration(t.total_s)}, {hours:,.0f} GPU-hours{cost}" if hours >= 100
            else f"  {t.steps:,} steps: {duration(t.total_s)}, {hours:.3g} GPU-hours{cost}",
        ]  # fmt: skip
        lines += [f"  note: {note}" for note in t.notes]
    lines += [f"note: {note}" for note in plan.notes]
    lines += ["", f"verdict: {plan.line()}"]
    return "\n".join(lines)


def render_pipeline(plans: list[StagePlan]) -> str:
    rows = [f"{'stage':<20}{'peak GiB':>9}  {'verdict':<13}{'step':>9}{'time':>11}{'GPU-h':>9}"]
    for plan in plans:
        t = plan.timing
        step, total = (duration(t.step_s), duration(t.total_s)) if t else ("-", "-")
        hours = "-" if t is None else f"{t.total_s / 3600 * plan.gpus:,.3g}" if t.total_s >= 36 else "< 0.01"
        rows.append(f"{plan.stage:<20}{gib(plan.peak):>9}  {plan.verdict:<13}{step:>9}{total:>11}{hours:>9}")
    return "\n\n".join([*(render(plan) for plan in plans), "pipeline summary\n" + "\n".join(rows)])


def run_plan(args: argparse.Namespace) -> None:
    plans, pipeline = plan_config(args)
    if args.json:
        payload: Any = {"stages": [plan_dict(p) for p in plans]} if pipeline else plan_dict(plans[0])
        print(json.dumps(payload, indent=2))
    else:
        print(render_pipeline(plans) if pipeline else render(plans[0]))
