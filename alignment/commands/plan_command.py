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
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from alignment.shared.stage_plan import Models, StagePlan, Target
from alignment.stages import registry
from alignment.stages.registry import Stage
from models.config_checks import check_model_size
from models.errors import ConfigError
from models.formats.checkpoint import load_model_config
from models.memory import GiB
from models.model import ModelConfig
from models.resources import model_preset_path, shipped_path
from trainer.config import load_config, load_preset, read_yaml
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
    file = shipped_path(path)
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist")
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


def model_named(name: str) -> ModelConfig:
    """``--model``: a preset (llama3.2-1b), a model YAML, or a checkpoint folder; its sizes within bounds."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder_model(folder, f"--model {name}")
    if not model_preset_path(name).is_file():
        raise ConfigError(f"--model {name!r} is neither a model preset, a model YAML nor a checkpoint folder")
    try:  # read as a stage config's model=NAME is: one loader, one-line errors
        config = ModelConfig.from_dict(OmegaConf.to_container(load_preset(name, f"--model {name}"), resolve=True))
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"--model {name}: {str(error).replace('ModelConfig.', 'model.')}") from error
    check_model_size(config, f"--model {name}")
    return config


def folder_model(folder: Path, key: str) -> ModelConfig:
    """The model config of a checkpoint folder, its sizes within bounds (a planned model is built on the meta device,
    one module per layer: an absurd size is refused, not built)."""
    try:
        config = load_model_config(folder)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {folder} holds no readable model config ({error})") from error
    check_model_size(config, f"{key} ({folder})")
    return config


class ModelResolver:
    """The model config a path in a stage config stands for: ``--model`` when given, a model planned upstream (the
    pipeline's), the folder's own config, else a one-line error asking for ``--model``."""

    def __init__(self, model: str | None, known: dict[str, ModelConfig] | None = None) -> None:
        self.model = model_named(model) if model else None
        self.known = known or {}

    def __call__(self, path: str | None, key: str, fallback: ModelConfig | None = None) -> ModelConfig:
        if self.model is not None:
            return self.model
        if path:
            if str(path) in self.known:
                return self.known[str(path)]
            if Path(path).expanduser().is_dir():
                return folder_model(Path(path).expanduser(), key)
            raise ConfigError(
                f"{key}: {path} does not exist (yet): name the model to plan with --model (a preset such as "
                "llama3.2-1b, a model YAML or a checkpoint folder)"
            )
        if fallback is None:
            raise ConfigError(f"{key} is not set: name the model to plan with --model")
        return fallback


def reward_paths(config: Any) -> list[tuple[str, str]]:
    terms = [(term.path, f"reward.terms[{i}].path") for i, term in enumerate(config.reward.terms) if term.kind == "reward_model"]  # fmt: skip
    if not config.reward.terms and getattr(config.init, "reward_model", None):
        terms.append((config.init.reward_model, "init.reward_model"))
    return terms


def stage_models(config: Any, resolve: ModelResolver) -> Models:
    """The models ``config`` names, by role, read from its ``init`` section: a checkpoint to fine-tune (SFT, the
    reward model), a policy with a reference (DPO), or a policy with the reward models that score its samples and,
    where the config has one, a critic (PPO); no init section: a model built from ``model`` (pretraining)."""
    init = getattr(config, "init", None)
    if init is None:
        return Models(resolve(None, "model", config.model))
    if hasattr(init, "checkpoint"):
        return Models(resolve(init.checkpoint, "init.checkpoint", config.model))
    if hasattr(init, "reference"):
        reference = resolve(init.reference, "init.reference") if init.reference else None
        return Models(resolve(init.policy, "init.policy", config.model), reference=reference)
    policy = resolve(init.policy, "init.policy")
    rewards = [resolve(path, key) for path, key in reward_paths(config)]
    critic = None
    if hasattr(init, "critic"):  # a copy of the reward model, else a fresh head on the policy's backbone
        critic = policy
        if init.critic == "reward_model" and (rewards or init.reward_model):
            critic = rewards[0] if rewards else resolve(init.reward_model, "init.reward_model")
    return Models(policy, rewards=rewards, critic=critic)


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
    for flag, value in (("--mfu", args.mfu), ("--bandwidth", args.bandwidth)):
        if value is not None and (value <= 0 or (flag == "--mfu" and value > 1)):
            raise ConfigError(f"{flag} must be {'in (0, 1]' if flag == '--mfu' else '> 0'}, got {value}")
    if args.price_per_gpu_hour is not None and args.price_per_gpu_hour < 0:
        raise ConfigError(f"--price-per-gpu-hour must be >= 0, got {args.price_per_gpu_hour}")
    return Target(gpu, args.mfu, args.fabric, args.bandwidth, args.price_per_gpu_hour)


def plan_config(args: argparse.Namespace) -> tuple[list[StagePlan], bool]:
    """The plan of a stage config, or one per model stage of a pipeline config; and whether it was a pipeline."""
    stage = detect_stage(args.config, args.overrides, args.stage)
    if stage is None:
        return plan_pipeline(args), True
    config = load_config(stage.schema, args.config, args.overrides)
    trainer = stage.training_section(config).trainer
    models = stage_models(config, ModelResolver(args.model))
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
        models = stage_models(config, ModelResolver(args.model, known))
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
        "batch": plan.batch, "device": plan.device, "gpus": plan.gpus, "capacity_bytes": plan.capacity, "peak_bytes": plan.peak, "peak_gib": plan.peak / GiB,
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
            + (f"communication {duration(t.communication_s)}: {t.communication})" if t.communication else "no collectives)"),
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
