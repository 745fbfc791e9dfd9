"""Precision settings: trainer.precision=auto per device, trainer.float32_matmul_precision, and FSDP2's MixedPrecisionPolicy for bf16-mixed
(bf16 parameters in compute, fp32 master weights, fp32 gradient reduction)."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from alignment.schemas.pretrain import PretrainConfig
from models.config_checks import check_config
from models.model import Transformer
from trainer import build
from trainer.build import apply_float32_matmul_precision, resolve_precision
from trainer.config import ConfigError, TrainerConfig, load_config
from trainer.parallel import apply_fsdp

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("value", ["highest", "high", "medium"])
def test_float32_matmul_precision_is_applied(value, restore_matmul_precision):
    assert apply_float32_matmul_precision(TrainerConfig(float32_matmul_precision=value)) == value
    assert torch.get_float32_matmul_precision() == value


def test_auto_is_tf32_on_cuda_and_highest_elsewhere(restore_matmul_precision):
    on_cpu = apply_float32_matmul_precision(TrainerConfig(accelerator="cpu"))
    assert on_cpu == "highest"
    expected = "high" if torch.cuda.is_available() else "highest"
    assert apply_float32_matmul_precision(TrainerConfig(accelerator="auto")) == expected


def test_a_bad_value_names_the_key():
    with pytest.raises(ConfigError, match="trainer.float32_matmul_precision"):
        load_config(PretrainConfig, ROOT / "configs/pretrain/tiny.yaml", ["trainer.float32_matmul_precision=fast"])
    with pytest.raises(ConfigError, match="trainer.float32_matmul_precision"):
        check_config(TrainerConfig(float32_matmul_precision="fast"), prefix="trainer.")  # type: ignore[arg-type]


@pytest.fixture
def one_rank_group(monkeypatch):
    """A gloo process group of one rank in this process: enough for fully_shard's mesh and its collectives.
    Its rendezvous variables are set for this test only (monkeypatch), never left for later tests' children."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_bf16_mixed_computes_in_bf16_keeps_fp32_master_weights_and_gradients(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Transformer(load_config(PretrainConfig, ROOT / "configs/pretrain/tiny.yaml", []).model)
    apply_fsdp(model, init_device_mesh("cpu", (1,)), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen: list[torch.dtype] = []
    model.layers[0].feed_forward.w1.register_forward_hook(lambda module, args, out: seen.append(module.weight.dtype))
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens).float().square().mean().backward()
    assert seen == [torch.bfloat16]  # the all-gathered weight the matmul used
    for name, parameter in model.named_parameters():  # sharded master weights and their gradients: fp32
        assert parameter.dtype == torch.float32, name
        assert parameter.grad is not None and parameter.grad.dtype == torch.float32, name


def test_auto_is_fp32_on_cpu_and_recorded_as_such() -> None:
    config = TrainerConfig(accelerator="cpu")
    assert config.precision == "auto"
    assert resolve_precision(config) == "32-true" and config.precision == "32-true"


def test_auto_is_bf16_mixed_on_a_gpu_with_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision(TrainerConfig(accelerator="auto")) == "bf16-mixed"
    assert resolve_precision(TrainerConfig(accelerator="cpu")) == "32-true"  # a GPU machine told to use its CPU


def test_explicit_precision_is_kept() -> None:
    config = TrainerConfig(accelerator="cpu", precision="32-true")
    assert resolve_precision(config) == "32-true"


def test_bf16_on_a_cpu_without_native_bf16_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "cpu_has_native_bf16", lambda: False)
    config = TrainerConfig(accelerator="cpu", precision="bf16-true")
    with pytest.warns(UserWarning, match="without native bf16"):
        assert resolve_precision(config) == "bf16-true"
    monkeypatch.setattr(build, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_precision(TrainerConfig(accelerator="cpu", precision="bf16-true"))
