"""trainer/plan.py and trainer/hardware.py: the training state a plan counts equals, byte for byte, what a real run
allocates (one process; FSDP2's shards on two gloo processes); the precision, time and verdict rules; the tables'
lookups and their one-line errors."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from models.adapters import add_adapters
from models.errors import ConfigError
from models.heads import ScalarModel
from models.memory import GiB
from models.model import ModelConfig, Transformer
from models.model_config import PeftConfig
from models.parameter_shapes import meta_parameters
from tests.helpers import spawn_ranks
from tests.trainer.fsdp_state_sizes import worker
from trainer.config import OptimConfig
from trainer.hardware import COLLECTIVE_EFFICIENCY, GPUS, MFU_FIGURES, gpu_from_device_name, gpu_named, mfu_for
from trainer.optim import optimizer_from_config
from trainer.plan import (
    collective_time,
    count,
    duration,
    gib,
    model_state,
    numerics_of,
    planned_precision,
    recompute_factor,
    verdict,
)


def allocated_state(model: torch.nn.Module, optimizer: str = "adamw") -> dict[str, int]:
    """Bytes a real run holds after one step of ``optimizer`` (optim.name): distinct parameters, their gradients,
    every optimizer tensor."""
    optimizer, _ = optimizer_from_config(model, OptimConfig(name=optimizer), max_steps=10)
    ids = torch.randint(0, 4096, (2, 16))
    outputs = model(ids)
    outputs.float().square().mean().backward()
    optimizer.step()
    parameters = list({id(p): p for p in model.parameters()}.values())
    return {
        "parameters": sum(p.numel() * p.element_size() for p in parameters),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in parameters if p.grad is not None),
        "optimizer": sum(
            v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        ),
    }  # fmt: skip


def planned(params, precision: str, **kwargs) -> dict[str, int]:
    state = model_state(params, precision, **kwargs)
    return {"parameters": state.parameters, "gradients": state.gradients, "optimizer": state.optimizer}


@pytest.mark.parametrize(("preset", "precision"), [("tiny", "32-true"), ("tiny", "bf16-true"), ("small", "32-true")])
def test_state_bytes_equal_a_real_single_process_run(preset, precision):
    config = ModelConfig.from_preset(preset)
    torch.manual_seed(0)
    model = Transformer(config)
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    assert planned(meta_parameters(config), precision) == allocated_state(model)


@pytest.mark.parametrize(("scalar", "precision"), [(False, "32-true"), (False, "bf16-true"), (True, "32-true")])
def test_muon_state_bytes_equal_a_real_run_and_are_adamws_less_one_moment(scalar, precision):
    """optim.name=muon: one momentum buffer (the gradient's dtype) per block matrix and no step count; AdamW's two
    moments and step count for the rest (embeddings, head, norms; a scalar model's head)."""
    config = ModelConfig.from_preset("tiny", tie_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(config)
    if scalar:
        model = ScalarModel.from_backbone(model).freeze_lm_head()
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    params = meta_parameters(config, scalar_head=scalar, trainable=("head.",) if scalar else ())
    assert planned(params, precision, optimizer="muon") == allocated_state(model, "muon")
    matrices = [p for name, p in model.named_parameters() if ".layers." in f".{name}" and p.ndim == 2]
    width = 2 if precision == "bf16-true" else 4
    saved = width * sum(p.numel() for p in matrices) + 4 * len(matrices)
    assert (
        model_state(params, precision).optimizer - model_state(params, precision, optimizer="muon").optimizer == saved
    )


def test_lantern_plan_counts_muons_state(capsys):
    from alignment.commands.cli import main

    def optimizer_item(*overrides: str) -> dict:
        assert main(["plan", "configs/pretrain/tiny.yaml", "trainer.precision=32-true", *overrides, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        items = [
            item for phase in plan["phases"] for item in phase["items"] if item["name"] == "model optimizer states"
        ]
        return items[0]

    adamw, muon = optimizer_item(), optimizer_item("optim.name=muon")
    params = meta_parameters(ModelConfig.from_preset("tiny"))
    matrices = [shape for shape, trains, block in params.tensors if trains and block and len(shape) == 2]
    assert adamw["bytes"] - muon["bytes"] == sum(4 * a * b + 4 for a, b in matrices) > 0
    assert muon["note"].startswith("Muon 1 x fp32 on block matrices, AdamW 2 x fp32")


def test_lora_state_bytes_equal_a_real_run():
    """With peft.kind=lora only the adapters have gradients and AdamW states; the frozen base keeps its weights."""
    config = ModelConfig.from_preset("tiny")
    peft = PeftConfig(kind="lora", rank=8)
    torch.manual_seed(0)
    model = add_adapters(Transformer(config), peft)
    params = meta_parameters(config, peft=peft)
    assert planned(params, "32-true") == allocated_state(model)
    assert planned(params, "32-true")["gradients"] == 4 * params.trainable < 4 * params.total // 10


def test_reward_model_state_bytes_equal_a_real_run():
    """A scalar model: its unused LM head is frozen (no gradient, no optimizer state); with LoRA its head trains."""
    config = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    model = ScalarModel.from_backbone(Transformer(config)).freeze_lm_head()
    assert planned(meta_parameters(config, scalar_head=True), "32-true") == allocated_state(model)
    peft = PeftConfig(kind="lora", rank=4)
    adapted = add_adapters(ScalarModel.from_backbone(Transformer(config)).freeze_lm_head(), peft, ("head.",))
    params = meta_parameters(config, scalar_head=True, peft=peft, trainable=("head.",))
    assert planned(params, "32-true") == allocated_state(adapted)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_fsdp2_shards_equal_each_ranks_local_bytes(tmp_path, precision):
    """Two gloo processes, FSDP2 over tiny with an odd vocabulary (4095 rows: rank 0 holds 2048, rank 1 2047): each
    rank's local parameters, gradients and optimizer states are what the plan counts for that rank."""
    out = tmp_path / "sizes"
    spawn_ranks(worker, (2, "tiny", precision, str(free_port()), str(out), {"vocab_size": 4095}), 2, tmp_path, 600)
    params = meta_parameters(ModelConfig.from_preset("tiny", vocab_size=4095))
    measured = [json.loads((tmp_path / f"sizes.{rank}").read_text()) for rank in range(2)]
    assert measured[0] != measured[1]  # the odd rows fall on rank 1's side
    for rank in range(2):
        assert planned(params, precision, sharded_over=2, rank=rank) == measured[rank]


def test_precision_rules():
    assert planned_precision("auto", on_gpu=True) == "bf16-mixed"
    assert planned_precision("auto", on_gpu=False) == "32-true"
    assert numerics_of("bf16-mixed", "fsdp") == "bf16"  # FSDP2 gathers bf16 weights
    assert numerics_of("bf16-mixed", "single") == "autocast"  # fp32 weights under autocast
    assert numerics_of("bf16-true", "ddp") == "bf16"
    assert numerics_of("32-true", "fsdp") == "fp32"
    params = meta_parameters(ModelConfig.from_preset("tiny"))
    mixed, true = model_state(params, "bf16-mixed"), model_state(params, "bf16-true")
    assert mixed.total == 2 * true.total - 4 * params.trainable_tensors  # fp32 vs bf16, the step counts alike
    assert model_state(params, "32-true", trains=False).gradients == 0


def test_time_rules():
    assert recompute_factor("none", 16, 2) == 1
    assert recompute_factor("full", 16, 2) == pytest.approx(6 / 8)
    assert recompute_factor("selective", 16, 2) == pytest.approx(6 / 7)
    h100 = gpu_named("h100")
    inside = collective_time(450e9, h100, nodes=1, gpus_per_node=8, fabric=None, bandwidth_gbs=None)
    alone = collective_time(450e9, h100, nodes=2, gpus_per_node=1, fabric=None, bandwidth_gbs=None)
    assert inside.fabric == "nvlink4" and alone.fabric == "ib-ndr"
    assert alone.seconds == pytest.approx(inside.seconds * 9)  # 450 vs one 50 GB/s link
    given = collective_time(100e9, h100, nodes=8, gpus_per_node=8, fabric="efa-p5", bandwidth_gbs=25.0)
    assert given.seconds == pytest.approx(4.0)


def test_collectives_across_nodes_run_at_the_whole_nodes_network_rate():
    """A ring over several nodes leaves each node once, its channels spread over the node's links: NCCL's bus
    bandwidth across 8-GPU A100 nodes with a 200 Gb/s link per GPU is the node's 200 GB/s, not one link's 25 (the
    plan had 64 A100s communication-bound, 5.1 s a step for torchtitan's Llama 2 13B, which ran its step in 4.3 s)."""
    a100 = gpu_named("a100-80g")
    rail = collective_time(100e9, a100, nodes=8, gpus_per_node=8, fabric=None, bandwidth_gbs=None)
    assert rail.fabric == "ib-hdr" and rail.bandwidth_gbs == pytest.approx(8 * 25 * COLLECTIVE_EFFICIENCY)
    shared = collective_time(100e9, a100, nodes=8, gpus_per_node=8, fabric="efa-p4d", bandwidth_gbs=None)
    assert shared.bandwidth_gbs == pytest.approx(50 * COLLECTIVE_EFFICIENCY)  # p4d: 400 Gb/s for the whole node
    h100 = gpu_named("h100")  # 8 x 400 Gb/s is 400 GB/s, under NVLink's 450: the node's network is the limit
    assert collective_time(1e9, h100, 2, 8, None, None).bandwidth_gbs == pytest.approx(400 * COLLECTIVE_EFFICIENCY)
    pcie = gpu_named("l40s")  # 8 x a 100 Gb/s share of Ethernet: the node's 12.5 GB/s, under PCIe's 32
    assert collective_time(1e9, pcie, 2, 8, None, None).bandwidth_gbs == pytest.approx(12.5 * COLLECTIVE_EFFICIENCY)


def test_formatting_and_verdicts():
    assert verdict(50, 100) == "fits" and verdict(95, 100) == "fits, tight" and verdict(101, 100) == "does not fit"
    assert gib(71.3 * GiB) == "71.3" and gib(0.5 * GiB) == "0.50" and gib(143 * GiB) == "143"
    assert count(1_235_814_400) == "1.24B" and count(11_272_192) == "11.3M"
    assert count(999_885_952) == "1B" and count(999_400_000) == "999M"  # never "1e+03M"
    assert duration(0.004) == "4 ms" and duration(5400) == "90 min" and duration(10 * 86400) == "10 days"


def test_gpu_table_lookups():
    with pytest.raises(ConfigError, match="h100, h100-pcie, h200") as error:
        gpu_named("h300")
    assert "\n" not in str(error.value)
    assert gpu_named("A100_80G").key == "a100-80g"
    assert gpu_from_device_name("NVIDIA H100 80GB HBM3").key == "h100"
    assert gpu_from_device_name("NVIDIA H100 PCIe").key == "h100-pcie"
    assert gpu_from_device_name("NVIDIA A100-SXM4-40GB").key == "a100-40g"
    assert gpu_from_device_name("NVIDIA L40S").key == "l40s"
    assert gpu_from_device_name("NVIDIA L4").key == "l4"
    assert gpu_from_device_name("Some Future GPU") is None
    assert all(gpu.memory_gib > 0 and gpu.bf16_tflops > 0 for gpu in GPUS.values())


def test_mfu_figures_say_where_they_come_from():
    """No MFU is Lantern's own yet: every default names its source and says it was not measured by Lantern."""
    assert not any(figure.measured_by_lantern for figure in MFU_FIGURES)
    for gpu in GPUS.values():
        choice = mfu_for(gpu, compiled=True)
        assert 0 < choice.mfu < 1 and "not measured by Lantern" in choice.source
    assert "borrowed" in mfu_for(gpu_named("l40s"), compiled=True).source
    assert mfu_for(gpu_named("h100"), compiled=True, override=0.5).mfu == 0.5
