"""trainer.compile: ``auto`` (the default) is on where the run uses CUDA and off on CPU, resolved once before the run
into the true or false its config.yaml records; true and false are kept; anything else is a one-line config error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from alignment.schemas.pretrain import PretrainConfig
from models.config_checks import check_config
from trainer.build import check_stage_config, resolve_compile
from trainer.config import ConfigError, TrainerConfig, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "pretrain" / "tiny.yaml"


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch):
    """Whether torch sees a GPU, as the test sets it."""

    def available(value: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: value)

    return available


def test_auto_is_the_default_and_off_on_cpu(cuda):
    cuda(False)
    assert TrainerConfig().compile == "auto"
    for accelerator in ("auto", "cpu"):
        config = TrainerConfig(accelerator=accelerator)
        assert resolve_compile(config) is False and config.compile is False


@pytest.mark.parametrize("accelerator", ["auto", "gpu"])
def test_auto_is_on_with_cuda(cuda, accelerator):
    cuda(True)
    config = TrainerConfig(accelerator=accelerator)
    assert resolve_compile(config) is True and config.compile is True


def test_auto_is_off_on_the_cpu_of_a_gpu_machine(cuda):
    cuda(True)
    assert resolve_compile(TrainerConfig(accelerator="cpu")) is False


@pytest.mark.parametrize("available", [False, True])
@pytest.mark.parametrize("value", [False, True])
def test_true_and_false_are_kept(cuda, available, value):
    cuda(available)
    config = TrainerConfig(accelerator="auto", compile=value)
    assert resolve_compile(config) is value and config.compile is value


@pytest.mark.parametrize(("written", "expected"), [("true", True), ("false", False), ("auto", False)])
def test_the_resolved_value_is_what_the_run_records(cuda, written, expected):
    cuda(False)
    config = load_config(PretrainConfig, TINY, [f"trainer.compile={written}"])
    check_stage_config(config, (None, []))  # no model folder: pretraining from scratch
    assert config.trainer.compile is expected
    assert yaml.safe_load(to_yaml(config))["trainer"]["compile"] is expected  # config.yaml's text


@pytest.mark.parametrize("value", ["fast", "1", "[true]"])
def test_a_bad_value_is_a_one_line_error_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"trainer\.compile") as error:
        load_config(PretrainConfig, TINY, [f"trainer.compile={value}"])
    assert "\n" not in str(error.value)


def test_a_bad_value_set_in_code_is_refused_before_the_run():
    with pytest.raises(ConfigError, match=r"^trainer\.compile must be auto, true or false, got 'fast'$"):
        check_config(TrainerConfig(accelerator="cpu", compile="fast"), prefix="trainer.")  # type: ignore[arg-type]


def test_cpu_presets_follow_auto():
    """Only GPU presets (trainer.accelerator: gpu) name trainer.compile, and then true; every CPU preset runs on the
    default, auto, which keeps the CPU pipeline eager."""
    named, gpu_presets = {}, set()
    for path in sorted((ROOT / "configs").glob("*/*.yaml")):
        trainer = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("trainer") or {}
        name = path.relative_to(ROOT).as_posix()
        if trainer.get("accelerator") == "gpu":
            gpu_presets.add(name)
        if "compile" in trainer:
            named[name] = trainer["compile"]
    assert {"configs/pretrain/llama3.2-1b.yaml", "configs/sft/llama3.2-1b-lora.yaml"} <= set(named)
    assert set(named) <= gpu_presets and set(named.values()) == {True}
