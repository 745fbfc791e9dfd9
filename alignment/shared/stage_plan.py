"""What a stage will need before it runs: memory per GPU, item by item and phase by phase, the verdict against the
GPU's memory (host memory on CPU), and the step time, tokens/s and cost; and the plans of the stages that train one
model on rows (``plan_pretrain``, ``plan_sft``, ``plan_rm``, ``plan_dpo``). A model folder that does not exist yet is
planned with the model given, never guessed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from models.memory import ActivationEstimate, activation_bytes, attention_path
from models.model import ModelConfig
from models.model_config import PeftConfig
from models.parameter_shapes import meta_parameters
from trainer.hardware import GPU, HOST_MEMORY_GBS, mfu_for
from trainer.plan import (
    collective_time,
    count,
    ddp_bytes_per_step,
    duration,
    fsdp_bytes_per_micro_batch,
    fsdp_working_bytes,
    gib,
    host_memory_bytes,
    model_state,
    numerics_of,
    offload_seconds,
    peak_flops,
    planned_precision,
    recompute_factor,
    state_dtype_bytes,
    usable_bytes,
    verdict,
)


@dataclass(frozen=True)
class Target:
    """Where the plan is for: a GPU (``None``: this machine's CPU, judged against host memory) and the figures that
    may be given instead of the tables' (MFU, interconnect, price)."""

    gpu: GPU | None = None
    mfu: float | None = None
    fabric: str | None = None
    bandwidth_gbs: float | None = None
    price_per_gpu_hour: float | None = None
    # the mean tokens a row of a rollout decodes before it stops (a run logs it as response_length): rows leave the
    # batch when they stop, so they cost decoding for that long; None: every row to response_max_tokens
    mean_response_tokens: float | None = None


@dataclass
class Models:
    """The model configs a stage holds: the one it trains (``policy``: pretraining's, SFT's, the reward model's
    backbone, DPO's and RL's policy), and those beside it."""

    policy: ModelConfig
    reference: ModelConfig | None = None  # DPO's init.reference, when it is another model
    rewards: list[ModelConfig] = field(default_factory=list)  # reward models scoring RL and rejection sampling
    critic: ModelConfig | None = None  # PPO's critic backbone
    others: dict[str, list[ModelConfig]] = field(default_factory=dict)  # any other role a stage declares, by name


@dataclass
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass
class Phase:
    name: str
    items: list[Item]
    moment: str = ""  # the moment of the peak inside the phase

    @property
    def total(self) -> int:
        return sum(item.bytes for item in self.items)


@dataclass
class Timing:
    tokens_per_step: int
    flops_per_token: float
    mfu: float  # what the step is planned at: the figure, rescaled from its run's recomputation to this one's
    mfu_figure: float  # the table's (or --mfu's)
    mfu_source: str
    compute_s: float
    communication_s: float
    communication: str
    step_s: float
    steps: int
    notes: list[str] = field(default_factory=list)
    host_s: float = 0.0  # cpu_offload: the AdamW step on the host, after the backward (not overlapped)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s else 0.0

    @property
    def total_s(self) -> float:
        return self.step_s * self.steps


@dataclass
class StagePlan:
    stage: str
    model: str  # a one-line description of the trained model
    run: str  # where and how it runs
    batch: str  # what one step sees
    phases: list[Phase]
    capacity: int | None  # bytes one device may use; None: unknown (no host figure)
    device: str
    gpus: int
    timing: Timing | None = None
    knob: str = ""
    notes: list[str] = field(default_factory=list)
    price_per_gpu_hour: float | None = None
    by_checkpointing: dict[str, int] = field(default_factory=dict)  # the micro-batch's peak activations per AC mode
    parameters: int = 0  # of the trained model, exactly (tied weights once)
    trainable_parameters: int = 0
    tokens_per_step: int = 0  # over every GPU (an RL step: the rollout's sequences at their longest)

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)

    @property
    def peak(self) -> int:
        return self.peak_phase.total

    @property
    def verdict(self) -> str:
        return "unknown" if self.capacity is None else verdict(self.peak, self.capacity)

    def line(self) -> str:
        """The one line a stage prints before it trains."""
        where = f"of {gib(self.capacity)} GiB {self.device}" if self.capacity else f"({self.device})"
        text = f"{self.verdict}: peak {gib(self.peak)} GiB {where}"
        if self.gpus == 0:  # the host's memory: an estimate, which says so, unless it cannot fit
            text = f"CPU run: peak {gib(self.peak)} GiB estimated {where}"
            text = f"does not fit: {text}" if self.verdict == "does not fit" else text
        if self.timing is not None:
            text += f"; step ~{duration(self.timing.step_s)}, {self.timing.tokens_per_s:,.0f} tokens/s"
        return text + (f"; {self.knob}" if self.knob else "")


def peft_of(sections: Any) -> PeftConfig | None:
    """The training section's LoRA settings when adapters train, else None (pretraining has no peft section)."""
    peft = getattr(sections, "peft", None)
    return peft if peft is not None and peft.enabled else None


@dataclass
class Setup:
    """The trainer section read once: precision as the run resolves it, numerics, GPUs, sharding."""

    precision: str
    strategy: str
    world: int
    numerics: str
    device: str  # cuda | cpu: which attention path and compute dtype the plan follows
    compiled: bool  # trainer.compile as the run resolves it (auto: on CUDA)

    @classmethod
    def of(cls, trainer: Any, target: Target) -> Setup:
        on_gpu = target.gpu is not None
        precision = planned_precision(trainer.precision, on_gpu)
        world = trainer.devices * trainer.num_nodes
        compiled = trainer.compile is True or (trainer.compile == "auto" and on_gpu)
        return cls(
            precision,
            trainer.strategy,
            world,
            numerics_of(precision, trainer.strategy),
            "cuda" if on_gpu else "cpu",
            compiled,
        )

    @property
    def shards(self) -> int:
        return self.world if self.strategy == "fsdp" else 1


def trained_items(
    label: str, params: Any, setup: Setup, trainer: Any, peft: PeftConfig | None, optim: Any = None
) -> list[Item]:
    """A trained model's parameters, gradients and optimizer states (``optim.name``'s: AdamW's, or Muon's and
    AdamW's) on one GPU (FSDP2's shard under fsdp), and FSDP2's gathered working weights; all on the host under
    ``trainer.cpu_offload``."""
    optimizer = getattr(optim, "name", "adamw")
    state = model_state(params, setup.precision, sharded_over=setup.shards, optimizer=optimizer)
    width = "bf16" if state_dtype_bytes(setup.precision) == 2 else "fp32"
    shard = f", 1/{setup.shards} shard" if setup.shards > 1 else ""
    trains = f"{count(params.trainable)} of {count(params.total)} train (LoRA)" if peft else ""
    offload = trainer.cpu_offload and setup.strategy == "fsdp"
    where = " (on the host: cpu_offload)" if offload else ""
    items = [
        Item(f"{label} parameters", 0 if offload else state.parameters, f"{width}{shard}{where}"),
        Item(f"{label} gradients", 0 if offload else state.gradients, trains or f"{width}{shard}"),
        Item(f"{label} optimizer states", 0 if offload else state.optimizer, optimizer_note(optimizer, width, shard)),
    ]
    if setup.strategy == "fsdp":
        gathered = fsdp_working_bytes(params, 4 if setup.precision == "32-true" else 2, setup.world)
        items.append(Item(f"{label} FSDP2 gathered weights", gathered, "root + 2 blocks unsharded"))
    return items


def optimizer_note(optimizer: str, width: str, shard: str) -> str:
    if optimizer == "muon":
        return f"Muon 1 x {width} on block matrices, AdamW 2 x {width} on the rest"
    return f"AdamW, 2 x {width}{shard}"


def frozen_items(label: str, params: Any, dtype_bytes: int, on_host: bool) -> list[Item]:
    note = f"frozen, {'bf16' if dtype_bytes == 2 else 'fp32'}" + (", on the host" if on_host else "")
    return [Item(label, 0 if on_host else dtype_bytes * params.total, note)]


def activation_items(estimate: ActivationEstimate, what: str) -> tuple[list[Item], str]:
    """(the saved activations and the working set on top of them at the peak, the moment of that peak)."""
    saved = estimate.saved_total
    return [
        Item(f"activations {what}", saved, "kept for backward"),
        Item("working set at the peak", estimate.peak - saved, estimate.peak_moment),
    ], estimate.peak_moment


def lm_activations(
    config: ModelConfig, setup: Setup, trainer: Any, batch: int, seq: int, *, masked: bool, head: str = "lm",
    peft: PeftConfig | None = None, params: Any = None, z_loss: bool = False,
) -> ActivationEstimate:  # fmt: skip
    return activation_bytes(
        config, batch, seq, numerics=setup.numerics, attention=attention_path(config, masked=masked, device=setup.device),
        ac=trainer.activation_checkpointing, ac_every=trainer.ac_every, head=head, chunk_size=trainer.loss_chunk_size,
        head_trains=peft is None, embedding_trains=peft is None, params=params, compiled=setup.compiled, z_loss=z_loss,
    )  # fmt: skip


def lm_flops_per_token(config: ModelConfig, seq: int, params: Any, *, head: bool = True) -> float:
    """Training FLOPs per token: ``ModelConfig.flops_per_token`` (6N + attention), less the weight gradients of
    frozen matrices (LoRA's base: 2 of the 6), less the LM head where none runs (a scalar head)."""
    flops = config.flops_per_token(seq) - 2 * params.numel(trains=False, in_block=True)
    head_matrix = config.vocab_size * config.dim
    if not head:
        flops -= 6 * head_matrix
    elif params.trainable < params.total:  # LoRA: the head is frozen too
        flops -= 2 * head_matrix
    return float(flops)


def step_timing(
    target: Target, setup: Setup, trainer: Any, *, tokens_per_step: int, flops_per_token: float, micro_batches: int,
    params: list[Any], compiled: bool, n_layers: int, extra_flops: float = 0.0, notes: list[str] | None = None,
) -> Timing | None:  # fmt: skip
    """The step at the table's MFU, rescaled from its run's activation checkpointing to this one's; FSDP2's collectives (or
    DDP's all-reduce) at the interconnect's rate; the step is the larger of the two (communication overlaps
    compute; what is left over is exposed)."""
    gpu = target.gpu
    if gpu is None or not peak_flops(gpu, setup.precision, trainer.float32_matmul_precision):
        return None  # a CPU run, or a GPU whose peak is unknown
    choice = mfu_for(gpu, compiled, target.mfu)
    # MFU counts the model's FLOPs only, so recomputation lowers it: the figure's run paid for its own checkpointing
    # (not again: 6,667 tokens/s planned for torchtitan's own setting, not 5,711), this run pays for its
    run = recompute_factor(trainer.activation_checkpointing, n_layers, trainer.ac_every)
    measured = (
        run
        if choice.measured_with is None
        else recompute_factor(choice.measured_with[0], n_layers, choice.measured_with[1])
    )
    mfu = choice.mfu * run / measured
    per_gpu_flops = (tokens_per_step * flops_per_token + extra_flops) / setup.world
    compute = per_gpu_flops / (peak_flops(gpu, setup.precision, trainer.float32_matmul_precision) * mfu)
    moved = 0.0
    for model in params:
        if setup.strategy == "fsdp" and setup.world > 1:
            moved += micro_batches * fsdp_bytes_per_micro_batch(
                model, 2 if setup.numerics == "bf16" else 4, setup.world
            )
        elif setup.strategy == "ddp" and setup.world > 1:
            moved += ddp_bytes_per_step(model, state_dtype_bytes(setup.precision), setup.world)
    comm = collective_time(moved, gpu, trainer.num_nodes, trainer.devices, target.fabric, target.bandwidth_gbs)
    how = f"{gib(comm.bytes_per_step)} GiB per GPU over {comm.fabric} at {comm.bandwidth_gbs:.0f} GB/s" if moved else ""
    communication, host = comm.seconds, 0.0
    if setup.strategy == "fsdp" and trainer.cpu_offload:
        width = state_dtype_bytes(setup.precision)
        for model in params:
            copies, optimizer = offload_seconds(model, gpu, setup.world, trainer.devices, width, micro_batches)
            communication, host = communication + copies, host + optimizer
        how += f"; cpu_offload's copies over {gpu.host_link} {duration(communication - comm.seconds)}"
    notes = list(notes or [])
    if host:
        notes.append(
            f"cpu_offload: AdamW on the host after each backward, {duration(host)} a step (the node's memory at "
            f"{HOST_MEMORY_GBS:.0f} GB/s shared by its {trainer.devices} GPUs' processes: assumed, not measured)"
        )
    if sum(p.total for p in params) < 3e8:
        notes.append(
            "the MFU figures come from billion-parameter models; one this small is bound by kernel launches and data "
            "loading, not FLOPs: read the time as a lower bound"
        )
    return Timing(
        tokens_per_step, flops_per_token, mfu, choice.mfu, choice.source, compute, communication, how.lstrip("; "),
        max(compute, communication) + host, trainer.max_steps, notes, host,
    )  # fmt: skip


def describe_model(config: ModelConfig, params: Any) -> str:
    trained = f", {count(params.trainable)} train" if params.trainable < params.total else ""
    return f"{count(params.total)} parameters{trained} ({config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size:,})"


def describe_run(setup: Setup, trainer: Any, target: Target) -> str:
    if target.gpu is None:
        return f"this machine's CPU, {setup.precision}, activation checkpointing {trainer.activation_checkpointing}"
    nodes = f" on {trainer.num_nodes} nodes" if trainer.num_nodes > 1 else ""
    strategy = {"fsdp": "FSDP2", "ddp": "DDP", "single": "one process"}[setup.strategy]
    compiled = ", compiled" if setup.compiled else ""
    return (
        f"{setup.world} x {target.gpu.name}{nodes}, {strategy}, {setup.precision}, activation checkpointing "
        f"{trainer.activation_checkpointing}{compiled}"
    )


def finish(plan: StagePlan, target: Target, setup: Setup) -> StagePlan:
    """The capacity one device has: the GPU's memory less its context, or the host's for a CPU run."""
    plan.capacity = usable_bytes(target.gpu) if target.gpu else host_memory_bytes()
    plan.device = f"per {target.gpu.name}" if target.gpu else "of host memory"
    plan.gpus = setup.world if target.gpu else 0
    plan.price_per_gpu_hour = target.price_per_gpu_hour
    return plan


def plan_pretrain(stage: Any, config: Any, models: Models, target: Target) -> StagePlan:
    loader = config.loader
    return plan_lm(
        stage, config, models, target, seq=loader.seq_len, rows=loader.micro_batch_size, masked=loader.document_masking,
        z_loss=config.optim.z_loss > 0,
    )  # fmt: skip


def plan_sft(stage: Any, config: Any, models: Models, target: Target) -> StagePlan:
    micro = config.loader.micro_batch_size
    return plan_lm(
        stage, config, models, target, seq=config.data.seq_len, rows=micro, masked=True, peft=peft_of(config),
        z_loss=config.optim.z_loss > 0,
    )  # fmt: skip


def plan_rm(stage: Any, config: Any, models: Models, target: Target) -> StagePlan:
    """The reward model: chosen and rejected rows through a ``ScalarModel`` (no logits)."""
    rows = 2 * config.loader.micro_batch_size
    return plan_lm(
        stage, config, models, target, seq=config.data.seq_len, rows=rows, masked=True, peft=peft_of(config),
        scalar=True,
    )  # fmt: skip


def plan_dpo(stage: Any, config: Any, models: Models, target: Target) -> StagePlan:
    """DPO: chosen and rejected rows beside a frozen reference, unless LoRA's adapters-off base is the reference
    (or SimPO needs none)."""
    peft = peft_of(config)
    rows = 2 * config.loader.micro_batch_size
    reference = config.loss.kind != "simpo" and bool(config.init.reference or peft is None)
    return plan_lm(
        stage, config, models, target, seq=config.data.seq_len, rows=rows, masked=False, peft=peft,
        reference=config.loss.reference_logprobs if reference else None,
    )  # fmt: skip


def plan_lm(
    stage: Any, config: Any, models: Models, target: Target, *, seq: int, rows: int, masked: bool,
    peft: PeftConfig | None = None, scalar: bool = False, reference: str | None = None, z_loss: bool = False,
) -> StagePlan:  # fmt: skip
    """One trained model on micro-batches of ``rows`` rows of ``seq`` tokens; ``reference``: a frozen reference's
    log-probs, ``precompute``d before the first step or ``on_the_fly``; ``z_loss``: the LM loss adds PaLM's z-loss."""
    trainer = config.trainer
    setup = Setup.of(trainer, target)
    params = meta_parameters(models.policy, scalar_head=scalar, peft=peft, trainable=("head.",) if scalar else ())
    estimate = lm_activations(
        models.policy, setup, trainer, rows, seq, masked=masked, head="scalar" if scalar else "lm", peft=peft,
        params=params, z_loss=z_loss,
    )  # fmt: skip
    items = trained_items("model", params, setup, trainer, peft, config.optim)
    phases, notes = [], []
    on_the_fly = False
    if reference is not None:
        ref_params = meta_parameters(models.reference or models.policy)
        ref_bytes = 2 if setup.numerics == "bf16" else 4  # dpo.reference_dtype
        frozen = frozen_items("reference (frozen)", ref_params, ref_bytes, on_host=False)
        if reference == "precompute":
            notes.append("the reference scores every pair once before the first step, then is freed")
            ref_forward = lm_activations(
                models.reference or models.policy, setup, trainer, rows, seq, masked=False, peft=peft
            ).moments["loss forward"]
            phases.append(
                Phase("reference pass", [items[0], *frozen, Item("reference forward", ref_forward, "no grad")])
            )
        else:
            on_the_fly = True
            items += frozen
            estimate.moments["reference forward"] = estimate.saved_total + estimate.moments["loss forward"]
    act, moment = activation_items(estimate, f"({rows} x {seq} tokens)")
    phases.insert(0, Phase("training", items + act, moment))
    by_checkpointing = {
        mode: lm_activations(
            models.policy, setup, with_overrides(trainer, {"activation_checkpointing": mode}), rows, seq, masked=masked,
            head="scalar" if scalar else "lm", peft=peft, params=params, z_loss=z_loss,
        ).peak
        for mode in ("none", "selective", "full")
    }  # fmt: skip
    world_tokens = rows * seq * trainer.accumulate_grad_batches * setup.world
    fpt = lm_flops_per_token(models.policy, seq, params, head=not scalar)
    extra = world_tokens * fpt / 3 if on_the_fly else 0.0  # the reference's forward: a third of a token's work
    timing = step_timing(
        target, setup, trainer, tokens_per_step=world_tokens, flops_per_token=fpt, extra_flops=extra,
        micro_batches=trainer.accumulate_grad_batches, params=[params], compiled=setup.compiled,
        n_layers=models.policy.n_layers, notes=notes,
    )  # fmt: skip
    accumulation = f" x {trainer.accumulate_grad_batches} accumulation" if trainer.accumulate_grad_batches > 1 else ""
    plan = StagePlan(
        stage.name, describe_model(models.policy, params), describe_run(setup, trainer, target),
        f"{rows} x {seq} tokens per GPU{accumulation} = {world_tokens:,} tokens per step", phases, None, "", 0,
        timing, notes=notes, by_checkpointing=by_checkpointing, parameters=params.total,
        trainable_parameters=params.trainable, tokens_per_step=world_tokens,
    )  # fmt: skip
    return finish(plan, target, setup)


def with_overrides(config: Any, changes: dict[str, Any]) -> Any:
    """A copy of ``config`` with dotted keys set (the knobs the verdict suggests are tried on copies)."""
    changed = copy.deepcopy(config)
    for key, value in changes.items():
        *path, last = key.split(".")
        section = changed
        for part in path:
            section = getattr(section, part)
        setattr(section, last, value)
    return changed
