"""A stage's plan with its verdict's knob, and the device a run plans for.

``plan_stage`` plans a stage (its record names its plan) and, when the peak does not fit, plans again with the
setting that would make it fit (``knob``): activation checkpointing or a smaller micro-batch when activations lead,
more GPUs, CPU offload or LoRA when the model's state does, the frozen models on the host or in bf16 for RL. Every
suggestion was planned and fits; the cheapest come first. A stage is read through its ``Stage`` record's
``name``, ``training_prefix``, ``rollout_section``, ``training_section`` and ``plan_without_knob``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from alignment.shared.plan_models import ModelResolver, stage_models
from alignment.shared.stage_plan import Models, StagePlan, Target, with_overrides
from models.errors import ConfigError, LanternError
from models.memory import GiB
from trainer.hardware import GPU, gpu_from_device_name
from trainer.plan import gib
from trainer.plan_check import PlannedRun, host_memory_now
from trainer.storage import is_global_rank_zero

log = logging.getLogger(__name__)

MAX_GPUS = 4096
STATE_ITEMS = (" parameters", " gradients", " optimizer states")  # what cpu_offload moves to the host


def plan_stage(stage: Any, config: Any, models: Models, target: Target) -> StagePlan:
    """The stage's plan; when it does not fit, with the knob that makes it fit."""
    plan = stage.plan_without_knob(config, models, target)
    if plan.verdict == "does not fit":
        plan.knob = knob(stage, config, models, target, plan)
    return plan


def _fits(stage: Any, config: Any, models: Models, target: Target, changes: dict[str, Any]) -> bool:
    plan = stage.plan_without_knob(with_overrides(config, changes), models, target)
    return plan.verdict != "does not fit"


def _largest_fitting(fits: Callable[[int], bool], below: int) -> int | None:
    """The largest value in [1, below) for which ``fits`` holds, if any (memory grows with it)."""
    low, high = 0, below
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low or None


def knob(stage: Any, config: Any, models: Models, target: Target, plan: StagePlan) -> str:
    """'<the largest item> N GiB: set A, or B' naming settings that each make the peak fit; else what comes closest."""
    prefix = stage.training_prefix
    sections = stage.training_section(config)
    trainer = sections.trainer
    phase = plan.peak_phase
    largest = max(phase.items, key=lambda item: item.bytes)
    options: list[str] = []

    def tried(changes: dict[str, Any], text: str) -> bool:
        if _fits(stage, config, models, target, {prefix + key: value for key, value in changes.items()}):
            options.append(text)
            return True
        return False

    rl = stage.rollout_section
    micro_key = f"{rl}.micro_batch_size" if rl else "loader.micro_batch_size"
    micro = getattr(config, rl).micro_batch_size if rl else sections.loader.micro_batch_size
    if trainer.activation_checkpointing != "full":
        if trainer.activation_checkpointing == "none":
            tried(
                {"trainer.activation_checkpointing": "selective"}, f"{prefix}trainer.activation_checkpointing=selective"
            )
        if not options:
            tried({"trainer.activation_checkpointing": "full"}, f"{prefix}trainer.activation_checkpointing=full")
    if trainer.loss_chunk_size is None and not rl:
        tried({"trainer.loss_chunk_size": 1024}, f"{prefix}trainer.loss_chunk_size=1024")
    best = _largest_fitting(lambda m: _fits(stage, config, models, target, {prefix + micro_key: m}), micro)
    if best:
        options.append(f"{prefix}{micro_key} ≤ {best}")
    if rl:
        hp = getattr(config, rl)
        if hp.frozen_device != "cpu":
            tried({f"{rl}.frozen_device": "cpu"}, f"{rl}.frozen_device=cpu")
        if hp.frozen_dtype != "bfloat16":
            tried({f"{rl}.frozen_dtype": "bfloat16"}, f"{rl}.frozen_dtype=bfloat16")
    peft = getattr(sections, "peft", None)  # pretraining has none: it trains every weight
    if peft is not None and not peft.enabled:
        tried({"peft.kind": "lora"}, f"{prefix}peft.kind=lora")
    if target.gpu is not None:
        options += _more_gpus(stage, config, models, target, prefix, trainer)
    if trainer.strategy == "fsdp" and not trainer.cpu_offload and target.gpu is not None:
        state = sum(item.bytes for item in phase.items if item.name.endswith(STATE_ITEMS))
        host = f" ({gib(state)} GiB of state per GPU in host memory)"
        tried({"trainer.cpu_offload": True}, f"{prefix}trainer.cpu_offload=true{host}")
    what = f"{largest.name.split(' (')[0]} {gib(largest.bytes)} GiB"
    if options:
        return f"{what}: set {', or '.join(options[:3])}"
    return f"{what}: no one setting makes it fit; {_combined(stage, config, models, target, prefix, micro_key)}"


def _combined(stage: Any, config: Any, models: Models, target: Target, prefix: str, micro_key: str) -> str:
    """Full activation checkpointing (and, for RL, the frozen models on the host) with the largest micro-batch that
    then fits, or with a micro-batch of 1 and the fewest GPUs FSDP2 needs."""
    base = {prefix + "trainer.activation_checkpointing": "full"}
    rl = stage.rollout_section
    if rl:
        base[f"{rl}.frozen_device"] = "cpu"
    named = " ".join(f"{key}={value}" for key, value in base.items())
    micro = getattr(config, rl).micro_batch_size if rl else stage.training_section(config).loader.micro_batch_size
    best = _largest_fitting(lambda m: _fits(stage, config, models, target, {**base, prefix + micro_key: m}), micro + 1)
    if best == micro:
        return f"together: {named}"
    if best:
        return f"together: {named} and {prefix}{micro_key} ≤ {best}"
    smallest = with_overrides(config, {**base, prefix + micro_key: 1})
    if target.gpu is not None:
        gpus = _more_gpus(stage, smallest, models, target, prefix, stage.training_section(smallest).trainer)
        if gpus:
            return f"together: {named}, {prefix}{micro_key}=1 and {gpus[0]}"
    return f"not even with {named}, a micro-batch of 1 and FSDP2 over {MAX_GPUS} GPUs"


def _more_gpus(stage: Any, config: Any, models: Models, target: Target, prefix: str, trainer: Any) -> list[str]:
    """FSDP2 over the fewest GPUs (of 8 a node past one node) on which the stage fits, if the state is the matter."""
    world = trainer.devices * trainer.num_nodes
    count = world * 2 if trainer.strategy == "fsdp" else max(world, 2)
    while count <= MAX_GPUS:
        devices, nodes = (count, 1) if count <= 8 else (8, -(-count // 8))
        changes = {"trainer.strategy": "fsdp", "trainer.devices": devices, "trainer.num_nodes": nodes}
        if _fits(stage, config, models, target, {prefix + key: value for key, value in changes.items()}):
            shape = f"{devices} GPUs" if nodes == 1 else f"{nodes} nodes x 8 GPUs"
            return [f"{prefix}trainer.strategy=fsdp over {shape} ({prefix}trainer.devices={devices} "
                    f"{prefix}trainer.num_nodes={nodes})"]  # fmt: skip
        count *= 2
    return []


def device_target(trainer: Any) -> Target:
    """The device a run trains on: the GPU torch sees (the table's entry with the memory the device really has, or
    one known only by its memory) or this machine's CPU."""
    if trainer.accelerator == "cpu" or not torch.cuda.is_available():
        return Target()
    name = torch.cuda.get_device_name()
    known = gpu_from_device_name(name)
    memory = torch.cuda.get_device_properties(0).total_memory / GiB
    if known is not None:  # an H100 of 94 or 96 GB is planned against what it has
        return Target(dataclasses.replace(known, memory_gib=memory))
    flops = float(trainer.peak_tflops or 0.0)
    return Target(GPU("cuda", name, memory, flops, flops, flops, 0.0, "pcie4", "eth-100g"))


def preflight(stage: Any, config: Any) -> PlannedRun | None:
    """The stage's plan on this machine's device, made from its models' configs before any weights load: printed as
    one line, and a ConfigError naming the knob when it does not fit (``trainer.plan_check=false`` runs it anyway).
    An estimate that fails is a warning and None: the plan is advice until it says a run cannot fit."""
    trainer = stage.training_section(config).trainer
    in_use = host_memory_now()[1]
    try:
        plan = stage.plan(config, stage_models(stage, config, ModelResolver(None)), device_target(trainer))
    except LanternError as error:
        # a missing or unreadable model, bad rows: the stage's own checks stop on it next, naming it their way (not
        # "training goes on", which it then did not)
        log.warning("plan: no estimate (%s)", error)
        return None
    except Exception as error:  # a bug of the estimate: advice lost, never the run
        log.warning("plan: no estimate (%s: %s); training goes on", type(error).__name__, error)
        return None
    line = plan.line()
    if plan.verdict == "does not fit" and trainer.plan_check:
        raise ConfigError(f"plan: {line} ({stage.training_prefix}trainer.plan_check=false runs it anyway)")
    if is_global_rank_zero():
        print(f"plan: {line}", flush=True)
    step = plan.timing.step_s if plan.timing is not None else None
    return PlannedRun(line, plan.peak, step, plan.device, in_use)
