"""The hardware Lantern plans for and reports MFU against: GPUs (memory, dense peak FLOP/s, memory bandwidth), the
interconnects between them, and published MFU figures, each with its source."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.errors import ConfigError

CONTEXT_GIB = 1.0  # CUDA context, NCCL buffers and the allocator's own: kept back from the GPU's memory
COLLECTIVE_EFFICIENCY = 0.8  # share of the line rate an all-gather / reduce-scatter reaches (assumed, not measured)
# trainer.cpu_offload's AdamW step on the host: a two-socket GPU server's memory streams ~300 GB/s (DGX A100: 410 GB/s
# peak, DGX H100: 614; assumed, not measured), shared by the node's GPUs' processes; the fused AdamW kernel reads a
# parameter, its gradient and both moments and writes three back: 28 bytes a parameter
HOST_MEMORY_GBS = 300.0
HOST_ADAMW_BYTES_PER_PARAMETER = 28


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_gib: float  # total, as nvidia-smi reports it
    bf16_tflops: float  # dense tensor-core peak
    tf32_tflops: float  # dense: 32-true matmuls on CUDA (trainer.float32_matmul_precision auto = high)
    fp32_tflops: float  # without tensor cores (float32_matmul_precision highest)
    memory_tbs: float  # HBM / GDDR bandwidth, TB/s
    intra_fabric: str  # between the GPUs of one node
    inter_fabric: str  # between nodes, unless --fabric names another
    host_link: str = "pcie4"  # to the host's memory (cpu_offload's copies)


GPUS: dict[str, GPU] = {
    gpu.key: gpu
    for gpu in (
        GPU("h100", "H100 SXM 80GB", 79.6, 989.4, 494.7, 66.9, 3.35, "nvlink4", "ib-ndr", "pcie5"),
        GPU("h100-pcie", "H100 PCIe 80GB", 79.6, 756.0, 378.0, 51.2, 2.0, "pcie5", "ib-ndr", "pcie5"),
        GPU("h200", "H200 SXM 141GB", 140.4, 989.4, 494.7, 66.9, 4.8, "nvlink4", "ib-ndr", "pcie5"),
        GPU("a100-80g", "A100 SXM 80GB", 80.0, 312.0, 156.0, 19.5, 2.039, "nvlink3", "ib-hdr"),
        GPU("a100-40g", "A100 SXM 40GB", 40.0, 312.0, 156.0, 19.5, 1.555, "nvlink3", "ib-hdr"),
        GPU("l40s", "L40S 48GB", 45.0, 362.0, 183.0, 91.6, 0.864, "pcie4", "eth-100g"),
        GPU("a10g", "A10G 24GB", 22.5, 125.0, 62.5, 31.2, 0.6, "pcie4", "eth-100g"),
        GPU("l4", "L4 24GB", 22.5, 121.0, 60.0, 30.3, 0.3, "pcie4", "eth-100g"),
        GPU("h100-nvl", "H100 NVL 94GB", 93.6, 835.0, 417.5, 60.0, 3.9, "pcie5", "ib-ndr", "pcie5"),
        GPU("l40", "L40 48GB", 45.0, 181.0, 90.5, 90.5, 0.864, "pcie4", "eth-100g"),
        # workstation and consumer cards (Ada / Ampere whitepapers): bf16 with fp32 accumulation, which GeForce
        # parts run at half their fp16-accumulate rate
        GPU("rtx-6000-ada", "RTX 6000 Ada 48GB", 48.0, 364.2, 182.1, 91.1, 0.96, "pcie4", "eth-100g"),
        GPU("rtx-a6000", "RTX A6000 48GB", 48.0, 154.8, 77.4, 38.7, 0.768, "pcie4", "eth-100g"),
        GPU("rtx-4090", "GeForce RTX 4090 24GB", 24.0, 165.2, 82.6, 82.6, 1.008, "pcie4", "eth-100g"),
        GPU("rtx-3090", "GeForce RTX 3090 24GB", 24.0, 71.0, 35.6, 35.6, 0.936, "pcie4", "eth-100g"),
    )
}


def gpu_by_numbers(
    base: GPU | None, memory_gib: float | None, bf16_tflops: float | None, memory_tbs: float | None
) -> GPU:
    """A GPU no name fits, given by its numbers (``--gpu-memory-gib``, ``--gpu-bf16-tflops``, ``--gpu-bandwidth``):
    a named one with those changed, or, with no name, one of exactly these (all three needed; TF32 and plain fp32
    taken as half the bf16 peak, PCIe inside a node)."""
    given = {"memory_gib": memory_gib, "bf16_tflops": bf16_tflops, "memory_tbs": memory_tbs}
    flags = {"memory_gib": "--gpu-memory-gib", "bf16_tflops": "--gpu-bf16-tflops", "memory_tbs": "--gpu-bandwidth"}
    if base is None:
        missing = [flags[key] for key, value in given.items() if value is None]
        if missing:
            raise ConfigError(
                f"a GPU given by its numbers needs {', '.join(missing)} too (or --gpu NAME to start from)"
            )
        name = f"GPU of {memory_gib:g} GiB, {bf16_tflops:g} bf16 TFLOP/s, {memory_tbs:g} TB/s"
        half = bf16_tflops / 2  # type: ignore[operator]
        return GPU("custom", name, memory_gib, bf16_tflops, half, half, memory_tbs, "pcie4", "eth-100g")  # type: ignore[arg-type]
    changes = {key: value for key, value in given.items() if value is not None}
    if "bf16_tflops" in changes:  # the tensor-core rates scale together
        scale = changes["bf16_tflops"] / base.bf16_tflops
        changes.update(tf32_tflops=base.tf32_tflops * scale)
    said = ", ".join(f"{flags[key]} {value:g}" for key, value in given.items() if value is not None)
    return dataclasses.replace(base, name=f"{base.name} ({said})", **changes)


# (nominal GB/s per GPU, one direction; what it is). Between nodes, each GPU's share of the node's network: a ring
# crosses it at the whole node's rate, the share times the node's GPUs in the run (trainer.plan.collective_time)
FABRICS: dict[str, tuple[float, str]] = {
    "nvlink4": (450.0, "NVLink 4 through NVSwitch (H100 / H200 SXM): 900 GB/s per GPU, both directions"),
    "nvlink3": (300.0, "NVLink 3 through NVSwitch (A100 SXM): 600 GB/s per GPU, both directions"),
    "pcie5": (64.0, "PCIe Gen5 x16"),
    "pcie4": (32.0, "PCIe Gen4 x16"),
    "ib-ndr": (50.0, "InfiniBand NDR, one 400 Gb/s link per GPU (DGX / HGX H100)"),
    "ib-hdr": (25.0, "InfiniBand HDR, one 200 Gb/s link per GPU (DGX A100)"),
    "efa-p5": (50.0, "AWS EFA on p5: 3200 Gb/s per 8 GPUs"),
    "efa-p4d": (6.25, "AWS EFA on p4d: 400 Gb/s per 8 GPUs"),
    "roce-400g": (50.0, "RoCE, 400 Gb/s per GPU"),
    "eth-100g": (1.5625, "100 Gb/s Ethernet per node of 8 GPUs"),
}


@dataclass(frozen=True)
class MFUFigure:
    gpus: tuple[str, ...]  # the GPU keys it applies to
    compiled: bool
    mfu: float
    workload: str
    source: str
    date: str
    # how the measured run checkpointed activations, in Lantern's terms (torchtitan's per-op selective checkpointing
    # recomputes about what Lantern's every-other-block does): the plan rescales the figure to the run's setting
    activation_checkpointing: str = "selective"
    ac_every: int = 2
    measured_by_lantern: bool = False


TORCHTITAN_H100 = (
    "pytorch/torchtitan docs/performance.md at commit d4c86e3 (2025-01-30), Table 1: Llama 3.1 8B, FSDP2 on 8 H100 "
    "(Grand Teton: HBM2e, 500 W, so below an SXM part's peak), bf16, selective activation checkpointing, local batch "
    "2 x 8192"
)
TORCHTITAN_A100 = (
    "pytorch/torchtitan docs/performance.md at commit 1ea476e (2024-04-24): Llama 3 8B, FSDP2 on 64 A100 80GB, bf16, "
    "selective (op) activation checkpointing, local batch 1 x 8192"
)
MFU_FIGURES: tuple[MFUFigure, ...] = (
    # MFU = tokens/s per GPU x ModelConfig.flops_per_token(8192) of llama3.1-8b / the GPU's dense bf16 peak
    MFUFigure(("h100", "h200", "h100-pcie"), True, 0.390, "6,667 tokens/s per GPU, torch.compile", TORCHTITAN_H100,
              "2024-12 (torch of 2024-12-23)"),
    MFUFigure(("h100", "h200", "h100-pcie"), False, 0.337, "5,762 tokens/s per GPU, eager", TORCHTITAN_H100,
              "2024-12 (torch of 2024-12-23)"),
    MFUFigure(("a100-80g", "a100-40g"), True, 0.552, "2,973 tokens/s per GPU (compile not stated)", TORCHTITAN_A100,
              "2024-04"),
)  # fmt: skip


def gpu_named(name: str) -> GPU:
    """The GPU a ``--gpu`` name means (case and ``_`` / ``-`` ignored); one line listing the known ones otherwise."""
    key = name.strip().lower().replace("_", "-")
    if key in GPUS:
        return GPUS[key]
    raise ConfigError(f"--gpu {name!r} is not a GPU Lantern knows: {', '.join(GPUS)}")


def gpu_from_device_name(device_name: str) -> GPU | None:
    """The table's entry for what ``torch.cuda.get_device_name`` says (e.g. 'NVIDIA H100 80GB HBM3'), if any."""
    name = device_name.upper()
    for key, gpu in sorted(GPUS.items(), key=lambda item: -len(item[0])):  # h100-pcie before h100, l40s before l4
        family, _, variant = key.upper().partition("-")
        if family in name and (not variant or variant.rstrip("G") in name or variant in name):
            return gpu
    return None


def peak_flops(gpu: GPU, precision: str, float32_matmul_precision: str = "auto") -> float:
    """FLOP/s the matmuls can reach on ``gpu``: bf16 tensor cores under bf16, TF32 under 32-true (``high``, what
    ``auto`` is on CUDA), plain fp32 under ``highest``."""
    if precision.startswith("bf16"):
        return gpu.bf16_tflops * 1e12
    return (gpu.fp32_tflops if float32_matmul_precision == "highest" else gpu.tf32_tflops) * 1e12


def fabric_named(name: str) -> tuple[float, str]:
    key = name.strip().lower()
    if key in FABRICS:
        return FABRICS[key]
    raise ConfigError(f"--fabric {name!r} is not an interconnect Lantern knows: {', '.join(FABRICS)}")


@dataclass(frozen=True)
class MFUChoice:
    mfu: float
    source: str  # one line: where the figure comes from, and whether Lantern measured it
    # the activation checkpointing (mode, every) the figure was measured under; None: --mfu, the planned run's own
    measured_with: tuple[str, int] | None = None


def mfu_for(gpu: GPU, compiled: bool, override: float | None = None) -> MFUChoice:
    """The MFU a step is planned at on ``gpu``: ``override`` (``--mfu``, the planned run's own), else the table's
    figure for that GPU and compile setting, else the closest figure, marked as borrowed; with the activation
    checkpointing the figure was measured under."""
    if override is not None:
        return MFUChoice(override, "--mfu (given)")
    for figure in MFU_FIGURES:
        if gpu.key in figure.gpus and figure.compiled == compiled:
            return MFUChoice(figure.mfu, _cite(figure, gpu), _checkpointing(figure))
    for figure in MFU_FIGURES:
        if gpu.key in figure.gpus:
            source = _cite(figure, gpu) + f"; compile={compiled} not measured there"
            return MFUChoice(figure.mfu, source, _checkpointing(figure))
    figure = MFU_FIGURES[0 if compiled else 1]
    source = f"no figure for the {gpu.name}: the H100's borrowed, " + _cite(figure, gpu)
    return MFUChoice(figure.mfu, source, _checkpointing(figure))


def _checkpointing(figure: MFUFigure) -> tuple[str, int]:
    return figure.activation_checkpointing, figure.ac_every


def _cite(figure: MFUFigure, gpu: GPU) -> str:
    who = "measured by Lantern" if figure.measured_by_lantern else "not measured by Lantern"
    source = figure.source.split(" at commit")[0]
    own = figure.gpus[0] == gpu.key
    return f"{source}, {figure.date}{'' if own else f', a {figure.gpus[0]} figure'}; {who}"


def command_device(flag: str | None) -> str:
    """A command's ``--device``: the flag as given (refused in one line where it names CUDA and none is there), else
    cuda when available, else cpu."""
    import torch

    from models.errors import LanternError

    device = flag or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise LanternError(f"--device {device}: not a device (cpu, cuda, cuda:N, mps)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise LanternError(f"--device {device}: CUDA is not available on this machine")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise LanternError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise LanternError(f"--device {device}: MPS is not available on this machine")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise LanternError(f"--device {device}: Lantern runs on cpu, cuda or mps")
    return device
