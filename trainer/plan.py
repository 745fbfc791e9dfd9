"""The stage-agnostic time and memory model of ``lantern plan``: training state per GPU at a precision and strategy,
FSDP2's collectives per step, the step time at an MFU, the verdict against a GPU's memory, and the plan line."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from models.memory import GiB, Numerics
from models.parameter_shapes import ParameterShapes
from trainer.hardware import (
    COLLECTIVE_EFFICIENCY,
    CONTEXT_GIB,
    GPU,
    HOST_ADAMW_BYTES_PER_PARAMETER,
    HOST_MEMORY_GBS,
    fabric_named,
    peak_flops,  # noqa: F401 - the stages' plans import it from here
)

log = logging.getLogger(__name__)

TIGHT = 0.9  # above this share of the usable memory a run fits only just: fragmentation may still push it over


def planned_precision(precision: str, on_gpu: bool) -> str:
    """``auto`` on a GPU (with bf16) or not: bf16-mixed, else 32-true; the one rule for a run (on the device it has)
    and a plan (on the device it plans for)."""
    if precision == "auto":
        return "bf16-mixed" if on_gpu else "32-true"
    return precision


def numerics_of(precision: str, strategy: str) -> Numerics:
    """How a forward computes: bf16 weights (bf16-true, or FSDP2's bf16 mixed precision), fp32 weights under bf16
    autocast (bf16-mixed without FSDP), or fp32."""
    if precision == "bf16-true" or (precision == "bf16-mixed" and strategy == "fsdp"):
        return "bf16"
    return "autocast" if precision == "bf16-mixed" else "fp32"


def state_dtype_bytes(precision: str) -> int:
    """Bytes per element of the kept parameters, their gradients and AdamW's moments."""
    return 2 if precision == "bf16-true" else 4


@dataclass(frozen=True)
class ModelState:
    """Bytes one GPU holds for a model's weights, gradients and optimizer states."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def model_state(
    params: ParameterShapes,
    precision: str,
    *,
    sharded_over: int = 1,
    rank: int = 0,
    trains: bool = True,
    optimizer: str = "adamw",
) -> ModelState:
    """What ``rank`` holds of a model trained with ``optimizer`` (optim.name) at ``precision``, its parameters sharded
    by FSDP2 over ``sharded_over`` GPUs (1: whole, as a single process or DDP keeps them). ``trains`` False: a frozen
    model, whose weights are all there is. Exactly what a run allocates (a test compares them)."""
    width = state_dtype_bytes(precision)
    parameters = width * params.shard_numel(sharded_over, rank)
    if not trains:
        return ModelState(parameters, 0, 0)
    trainable = params.shard_numel(sharded_over, rank, trains=True)
    # AdamW: two moments and a 0-dim fp32 step count per tensor; Muon (never sharded: refused under FSDP) keeps one
    # momentum buffer per block matrix, in the gradient's dtype, and no step count
    matrices = muon_matrices(params) if optimizer == "muon" else []
    muon = sum(math.prod(shape) for shape in matrices)
    adamw = 2 * width * (trainable - muon) + 4 * (params.trainable_tensors - len(matrices))
    return ModelState(parameters, width * trainable, adamw + width * muon)


def muon_matrices(params: ParameterShapes) -> list[tuple[int, ...]]:
    """The shapes Muon optimises (``trainer/muon.py``): the transformer blocks' trained 2-D weights."""
    return [shape for shape, trains, in_block in params.tensors if trains and in_block and len(shape) == 2]


def fsdp_working_bytes(params: ParameterShapes, compute_bytes: int, world: int) -> int:
    """FSDP2's unsharded weights in use at once: the root's (embeddings, final norm, heads: gathered for the whole
    step), the block that computes and the one prefetched, in the compute dtype; plus the unsharded fp32 gradient of
    one block's trained parameters for the reduce-scatter, and its output shard (a frozen block, LoRA's base, has
    none)."""
    block = params.block_numel()
    trained = params.block_numel(trains=True)
    root = params.numel(in_block=False)
    return compute_bytes * (root + 2 * block) + 4 * trained + 4 * -(-trained // world)


@dataclass(frozen=True)
class Communication:
    bytes_per_step: int  # what one GPU sends (= receives) per optimizer step
    bandwidth_gbs: float  # achieved, per GPU
    fabric: str
    seconds: float


def collective_time(
    bytes_per_step: float, gpu: GPU, nodes: int, gpus_per_node: int, fabric: str | None, bandwidth_gbs: float | None
) -> Communication:
    """Ring collectives (NCCL's all-gather / reduce-scatter): each GPU moves (W - 1) / W of the data. Inside one node
    at its NVLink / PCIe rate; across nodes a ring leaves each node once, its channels spread over the node's network
    links, so the rate is the whole node's network bandwidth (its GPUs x each one's share of ``fabric``), never more
    than the link inside the node: what NCCL reports as bus bandwidth."""
    if bandwidth_gbs is not None:
        return Communication(int(bytes_per_step), bandwidth_gbs, "--bandwidth", bytes_per_step / (bandwidth_gbs * 1e9))
    inside = fabric_named(gpu.intra_fabric)[0]
    if nodes > 1:
        name = fabric or gpu.inter_fabric
        line = min(inside, gpus_per_node * fabric_named(name)[0])
    else:
        name, line = gpu.intra_fabric, inside
    achieved = line * COLLECTIVE_EFFICIENCY
    return Communication(int(bytes_per_step), achieved, name, bytes_per_step / (achieved * 1e9))


def offload_seconds(
    params: ParameterShapes, gpu: GPU, world: int, gpus_per_node: int, state_bytes: int, micro_batches: int
) -> tuple[float, float]:
    """``trainer.cpu_offload`` (FSDP2's CPUOffloadPolicy), per optimizer step: (the host link's copies, overlapped
    with compute like the collectives: every micro-batch each GPU copies its parameter shard in for the forward and
    again for the backward, and its gradient shard out; the AdamW step on the host, after the backward: every GPU's
    process of a node at once, bound by the host's memory bandwidth)."""
    shard, trained = params.shard_numel(world), params.shard_numel(world, trains=True)
    copied = micro_batches * (2 * state_bytes * shard + 4 * trained)
    link = fabric_named(gpu.host_link)[0] * COLLECTIVE_EFFICIENCY
    optimizer = gpus_per_node * trained * HOST_ADAMW_BYTES_PER_PARAMETER / (HOST_MEMORY_GBS * 1e9)
    return copied / (link * 1e9), optimizer


def fsdp_bytes_per_micro_batch(params: ParameterShapes, compute_bytes: int, world: int) -> float:
    """FSDP2 per micro-batch (Lightning's FSDP2 strategy reduce-scatters at every backward, accumulating or not):
    all-gather of every weight in forward and again in backward, reduce-scatter of the trainable ones' gradients in
    fp32; each GPU moves (W - 1) / W of each."""
    share = (world - 1) / world
    return share * (2 * compute_bytes * params.total + 4 * params.trainable)


def ddp_bytes_per_step(params: ParameterShapes, grad_bytes: int, world: int) -> float:
    """DDP: one all-reduce of the gradients per optimizer step (no sync while accumulating): 2 (W - 1) / W of them."""
    return 2 * (world - 1) / world * grad_bytes * params.trainable


def recompute_factor(ac: str, n_layers: int, every: int) -> float:
    """Model FLOPs over the FLOPs the GPU runs: checkpointed blocks run their forward twice (2 of the 6 units of a
    training token), so full checkpointing does 8/6 of the work, selective 1 + 1/3 of the wrapped share."""
    from models.memory import checkpointed_blocks

    share = checkpointed_blocks(n_layers, ac, every) / max(n_layers, 1)
    return 6 / (6 + 2 * share)


def usable_bytes(gpu: GPU) -> int:
    return int((gpu.memory_gib - CONTEXT_GIB) * GiB)


def verdict(peak: int, capacity: int) -> str:
    """fits / fits, tight / does not fit, against ``capacity`` bytes."""
    if peak > capacity:
        return "does not fit"
    return "fits, tight" if peak > TIGHT * capacity else "fits"


def host_memory_bytes() -> int | None:
    """This machine's physical memory (CPU runs are judged against it), if the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gib(value: float) -> str:
    """Bytes as GiB for a person: 0.004, 0.38, 7.6, 143."""
    amount = value / GiB
    if amount >= 100:
        return f"{amount:.0f}"
    if amount >= 10:
        return f"{amount:.1f}"
    return f"{amount:.2f}" if amount >= 0.01 else f"{amount:.3f}"


def count(value: float) -> str:
    """A parameter or token count for a person: 1.24B, 11.3M, 512k."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= 0.9995 * scale:  # what rounds to 1000 of the unit below is 1 of this one (Gemma 3 1B: 1B)
            return f"{value / scale:.3g}{unit}"
    return f"{value:.0f}"


def duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:.3g} days"
