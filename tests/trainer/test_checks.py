"""Unit tests of the checks made before any compute: the tokenizer/model fit checks, the trainer section's rules
(check_config) and what a run readies once (prepare_trainer), the callback order of fit_stage and the resume
choice. No training runs here; every test takes well under a second."""

from __future__ import annotations

import base64
import logging
import re
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from data.tokenizer.tokenizer import Tokenizer
from models.config_checks import check_config
from models.errors import ConfigError
from models.model import ModelConfig
from trainer.build import in_save_order, lightning_precision, make_strategy, prepare_trainer
from trainer.callbacks import DataProgress, ExportFinal, LossPlot
from trainer.checks import check_initial_model, check_same_tokenizer, check_tokenizer_fits_model, resolve_resume
from trainer.config import CheckpointConfig, OptimConfig, TrainerConfig
from trainer.storage import AtomicCheckpoint

# ---- tokenizer and initial model


def small_model(**changes) -> ModelConfig:
    return ModelConfig(**{"dim": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 512, "max_seq_len": 64, **changes})


def test_a_tokenizer_may_be_smaller_than_the_embeddings_but_never_larger():
    check_tokenizer_fits_model(SimpleNamespace(vocab_size=512), small_model(vocab_size=512))  # equal
    check_tokenizer_fits_model(SimpleNamespace(vocab_size=300), small_model(vocab_size=512))  # padded table
    with pytest.raises(ValueError) as caught:
        check_tokenizer_fits_model(
            SimpleNamespace(vocab_size=513, path="tok.model"), small_model(vocab_size=512), model_name="ckpt/"
        )
    message = str(caught.value)
    assert "tok.model has 513 tokens" in message and "ckpt/ has vocab_size 512" in message
    assert "model.vocab_size >= 513" in message  # says what to set


def byte_tokenizer(swap: bool = False) -> tuple[dict[bytes, int], bytes]:
    ranks = {bytes([i]): i for i in range(256)}
    if swap:  # same size, different ids: exactly what the check is for
        ranks[b"a"], ranks[b"b"] = ranks[b"b"], ranks[b"a"]
    raw = b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    return ranks, raw


def test_a_checkpoint_must_be_used_with_the_tokenizer_it_carries(tmp_path):
    ranks, raw = byte_tokenizer()
    tokenizer = Tokenizer(ranks, path="mine.model")
    check_same_tokenizer(tokenizer, tmp_path, key="data.tokenizer")  # the folder carries none: nothing to compare
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(raw)  # Meta's layout
    check_same_tokenizer(tokenizer, tmp_path, key="data.tokenizer")  # the same ranks: same fingerprint

    other_ranks, _ = byte_tokenizer(swap=True)
    other = Tokenizer(other_ranks, path="other.model")
    assert other.vocab_size == tokenizer.vocab_size and other.fingerprint != tokenizer.fingerprint
    with pytest.raises(ValueError) as caught:
        check_same_tokenizer(other, tmp_path, key="data.tokenizer")
    assert f"set data.tokenizer={tmp_path / 'original' / 'tokenizer.model'}" in str(caught.value)
    assert "other.model" in str(caught.value)

    (tmp_path / "tokenizer.model").write_bytes(byte_tokenizer(swap=True)[1])  # the top-level file is read first
    check_same_tokenizer(other, tmp_path, key="data.tokenizer")


def stage_config(model: ModelConfig, seq_len: int, checkpoint: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        init=SimpleNamespace(checkpoint=checkpoint), model=model, data=SimpleNamespace(seq_len=seq_len)
    )


def test_initial_model_from_a_checkpoint_replaces_the_configured_one(tmp_path, caplog):
    built = small_model(n_layers=2)
    config = stage_config(small_model(), seq_len=32, checkpoint=str(tmp_path))  # no tokenizer in the folder
    with caplog.at_level(logging.WARNING):
        check_initial_model(config, SimpleNamespace(vocab_size=512), built)
    assert config.model is built
    assert "model section ignored" in caplog.text
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} has vocab_size 512")):  # named as the model
        check_initial_model(config, SimpleNamespace(vocab_size=600, path="big.model"), built)


def test_a_model_section_nobody_set_is_replaced_without_a_warning(tmp_path, caplog):
    """The pipeline's stage presets name no model (they start from the previous stage's): the schema's default
    section then stands for nothing the user asked for, and a default run prints no warning about it."""
    built = small_model(n_layers=2)
    config = stage_config(ModelConfig(), seq_len=32, checkpoint=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        check_initial_model(config, SimpleNamespace(vocab_size=512), built)
    assert config.model is built
    assert "model section ignored" not in caplog.text


def test_initial_model_without_a_checkpoint_keeps_the_config_and_names_model_vocab_size(caplog):
    configured = small_model()
    config = stage_config(configured, seq_len=32)
    with caplog.at_level(logging.WARNING):
        check_initial_model(config, SimpleNamespace(vocab_size=512), small_model(n_layers=2))
    assert config.model is configured and "model section ignored" not in caplog.text
    with pytest.raises(ValueError, match=r"the model \(model\.vocab_size\) has vocab_size 512"):
        check_initial_model(config, SimpleNamespace(vocab_size=513, path="t"), configured)


# ---- trainer/build.py: what is checked before a Trainer exists


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"strategy": "single", "devices": 2}, r"trainer\.strategy 'single' .* trainer\.devices=2"),
        ({"strategy": "single", "num_nodes": 2}, r"trainer\.num_nodes=2"),
        ({"strategy": "ddp", "devices": 0}, r"trainer\.devices must be >= 1 but got 0"),
        ({"max_steps": 0}, r"trainer\.max_steps must be >= 1"),
        ({"val_every_n_steps": 0}, r"trainer\.val_every_n_steps must be >= 1"),
        ({"cpu_offload": True, "strategy": "ddp"}, r"trainer\.cpu_offload needs trainer\.strategy 'fsdp'"),
        ({"cpu_offload": True, "strategy": "fsdp", "accelerator": "cpu"}, r"trainer\.cpu_offload .* needs GPUs"),
        ({"init_device": "meta", "strategy": "ddp"}, r"trainer\.init_device 'meta' needs trainer\.strategy 'fsdp'"),
    ],
)
def test_trainer_config_errors_name_the_keys(changes, message, restore_matmul_precision):
    with pytest.raises(ConfigError, match=message):
        check_config(TrainerConfig(**changes), prefix="trainer.")


def test_cpu_offload_without_gpus_is_refused_when_the_run_is_readied(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = TrainerConfig(cpu_offload=True, strategy="fsdp", devices=2)
    check_config(config, prefix="trainer.")  # the section itself is valid: the machine has no GPUs
    with pytest.raises(ConfigError, match=r"trainer\.cpu_offload .* needs GPUs"):
        prepare_trainer(config)


def test_a_run_resolves_precision_on_cpu(restore_matmul_precision):
    config = TrainerConfig(accelerator="cpu", strategy="fsdp", init_device="meta", devices=2)  # valid on CPU
    check_config(config, prefix="trainer.")
    prepare_trainer(config)
    assert config.precision == "32-true"  # auto on CPU, recorded in the config
    assert torch.get_float32_matmul_precision() == "highest"


def test_lightning_gets_no_autocast_under_fsdp_bf16_mixed():
    """FSDP2's MixedPrecisionPolicy does bf16-mixed (trainer/parallel.py); Lightning must not autocast on top."""
    assert lightning_precision(TrainerConfig(strategy="fsdp", precision="bf16-mixed")) == "32-true"
    assert lightning_precision(TrainerConfig(strategy="ddp", precision="bf16-mixed")) == "bf16-mixed"
    assert lightning_precision(TrainerConfig(strategy="fsdp", precision="bf16-true")) == "bf16-true"


def test_strategies():
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    assert make_strategy(TrainerConfig(strategy="single")) == "auto"
    assert isinstance(make_strategy(TrainerConfig(strategy="ddp")), DDPStrategy)
    assert isinstance(make_strategy(TrainerConfig(strategy="fsdp", devices=2, num_nodes=3)), ModelParallelStrategy)


def test_checkpoints_are_saved_after_every_recorder_and_before_the_export(tmp_path):
    """fit_stage's order: whatever records a step runs before that step's checkpoint; the export runs last."""
    save = AtomicCheckpoint(tmp_path / "checkpoints", every_n_steps=1)
    export = ExportFinal(tmp_path / "final", None)
    progress, plot, extra = DataProgress(), LossPlot(tmp_path), L.Callback()
    ordered = in_save_order([save, export, progress, plot, extra])
    assert ordered == [progress, plot, extra, save, export]
    assert in_save_order([progress, extra]) == [progress, extra]  # nothing else moves


def test_atomic_checkpoint_refuses_a_zero_interval(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps"):
        AtomicCheckpoint(tmp_path, every_n_steps=0)
    with pytest.raises(ValueError, match="keep_last"):
        AtomicCheckpoint(tmp_path, every_n_steps=1, keep_last=0)


def test_resume_choice(tmp_path):
    assert resolve_resume(CheckpointConfig(resume="none"), tmp_path) is None
    assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path / "no-such-folder") is None
    assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path) is None  # empty: a fresh start
    with pytest.raises(ConfigError, match=r"checkpoint\.resume: .*missing\.ckpt does not exist"):
        resolve_resume(CheckpointConfig(resume=str(tmp_path / "missing.ckpt")), tmp_path)
    given = tmp_path / "step-00000004.ckpt"
    torch.save({"state_dict": {}}, given)
    assert resolve_resume(CheckpointConfig(resume=str(given)), tmp_path / "elsewhere") == str(given)


def test_a_section_checked_on_its_own_gets_its_prefix():
    check_config(OptimConfig(), "<test>", prefix="optim.")
    with pytest.raises(ConfigError, match=r"^<test>: critic_optim\.min_lr \(1\.0\) must be <= critic_optim\.lr"):
        check_config(OptimConfig(lr=0.5, min_lr=1.0), "<test>", prefix="critic_optim.")
