"""Continued pretraining (``init.checkpoint`` in the pretrain stage): every source Lantern reads starts a run with its
own weights, shape and tokenizer; what does not fit is refused in one line before compute; the real SmolLM2 GGUF
continues with its tokenizer and chat template kept in ``final/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from alignment.commands.cli import main as lantern
from alignment.schemas.pretrain import PretrainConfig
from alignment.stages.pretrain import run_pretrain
from alignment.stages.registry import stage_named
from data.pretrain.manifest import read_manifest
from data.tokenizer.base import load_tokenizer
from models.errors import ConfigError
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.model import ModelConfig, Transformer
from trainer.checks import resolve_stage_tokenizer
from trainer.config import load_config, load_preset

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "pretrain" / "tiny.yaml"
CORPUS = ROOT / "data" / "corpus" / "tinyshakespeare.txt"


def tiny_model_config() -> ModelConfig:
    return ModelConfig.from_dict(OmegaConf.to_container(load_preset("tiny", "test")))


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    """A native folder of the tiny preset's shape with the bundled tokenizer, weights not from any run.seed."""
    torch.manual_seed(99)
    folder = tmp_path_factory.mktemp("start") / "model"
    return save_checkpoint(Transformer(tiny_model_config()), folder, tokenizer_path=load_tokenizer("default").path)


def config_for(tmp: Path, *overrides: str) -> PretrainConfig:
    return load_config(
        PretrainConfig,
        TINY,
        [f"data.source=[{CORPUS}]", f"data.out_dir={tmp / 'data'}", f"run.out_dir={tmp / 'runs'}", *overrides],
    )


def prepared(config: PretrainConfig) -> PretrainConfig:
    """``lantern prepare`` of ``config`` as the command does it (data.tokenizer: auto resolved to the checkpoint's)."""
    from data.pretrain.prepare import prepare

    resolve_stage_tokenizer(config, *stage_named("pretrain").model_folders(config))
    prepare(config.data)
    return config


def weights_close(a: torch.nn.Module, b: torch.nn.Module, atol: float) -> bool:
    other = b.state_dict()
    return all(torch.allclose(t, other[name], atol=atol) for name, t in a.state_dict().items())


def test_a_folder_continues_with_its_weights_and_tokenizer(start: Path, tmp_path: Path) -> None:
    # lr so small that the weights barely move: final/ is the checkpoint's, not the seeded random model's
    overrides = (f"init.checkpoint={start}", "data.tokenizer=auto", "optim.lr=1e-9", "optim.min_lr=0")
    config = prepared(config_for(tmp_path, *overrides, "trainer.max_steps=2"))
    assert config.data.tokenizer == str((start / "tokenizer.model").absolute())
    assert read_manifest(config.data.out_dir)["tokenizer"]["fingerprint"] == load_tokenizer("default").fingerprint
    run_dir = run_pretrain(config_for(tmp_path, *overrides, "trainer.max_steps=2"))
    final = load_checkpoint(run_dir / "final")
    assert weights_close(final, load_checkpoint(start), atol=1e-6)
    torch.manual_seed(config.run.seed)
    assert not weights_close(final, Transformer(tiny_model_config()), atol=1e-3)
    assert (run_dir / "final" / "tokenizer.model").read_bytes() == (start / "tokenizer.model").read_bytes()

    # the run's training checkpoint is a source too: a second phase starts where the first ended
    ckpt = sorted((run_dir / "checkpoints").glob("*.ckpt"))[-1]
    second = config_for(tmp_path, f"init.checkpoint={ckpt}", "run.name=phase-two", "trainer.max_steps=1")
    resolve_stage_tokenizer(second, *stage_named("pretrain").model_folders(second))
    assert load_tokenizer(second.data.tokenizer).fingerprint == load_tokenizer("default").fingerprint
    phase_two = run_pretrain(
        config_for(tmp_path, f"init.checkpoint={ckpt}", "run.name=phase-two", "trainer.max_steps=1")
    )
    assert json.loads((phase_two / "final" / "lantern.json").read_text())["model"] == tiny_model_config().to_dict()


def test_a_model_section_that_disagrees_is_refused_naming_both_values(start: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"init.checkpoint .* does not fit the model section: model.dim=96 but the checkpoint's is 128",
    ):
        config_for(tmp_path, f"init.checkpoint={start}", "model.dim=96")
    # the tiny preset's own section (the checkpoint's shape) and a runtime choice are accepted
    assert config_for(tmp_path, f"init.checkpoint={start}", "model.attention=sdpa").init.checkpoint == str(start)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("init.checkpoint={corpus}", r"init.checkpoint: .* is a file but neither a .gguf file nor a .ckpt"),
        ("trainer.init_device=meta", r"trainer.init_device 'meta' builds random weights .* init.checkpoint"),
    ],
)
def test_bad_starts_are_one_line_at_load(start: Path, tmp_path: Path, override: str, message: str) -> None:
    given = override.format(corpus=CORPUS)
    extra = [] if given.startswith("init.") else [f"init.checkpoint={start}", "trainer.strategy=fsdp"]
    with pytest.raises(ConfigError, match=message):
        config_for(tmp_path, given, *extra)


def test_a_missing_start_is_one_line_before_prepare_and_training(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "not-converted-yet"
    config = config_for(tmp_path, f"init.checkpoint={missing}")  # loads: a later command may write it
    with pytest.raises(ConfigError, match=r"init.checkpoint: .*not-converted-yet does not exist"):
        run_pretrain(config)
    assert lantern(["prepare", str(TINY), f"init.checkpoint={missing}", f"data.out_dir={tmp_path / 'd'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "init.checkpoint" in err and "does not exist" in err and "\n" not in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "runs").exists()


def test_another_tokenizer_than_the_checkpoints_is_refused(start: Path, tmp_path: Path) -> None:
    from data.tokenizer.convert import write_hf_tokenizer

    # the same merges written as a Hugging Face tokenizer.json: another tokenizer file, so refused all the same
    other = write_hf_tokenizer(load_tokenizer("default"), tmp_path / "other")
    json_file = next(path for path in other if path.name == "tokenizer.json")
    config = config_for(tmp_path, f"init.checkpoint={start}", f"data.tokenizer={json_file}")
    with pytest.raises(ConfigError, match="carries its tokenizer"):
        resolve_stage_tokenizer(config, *stage_named("pretrain").model_folders(config))


@pytest.mark.slow
def test_smollm2_gguf_continues_with_its_tokenizer_and_template(smollm2, tmp_path: Path) -> None:
    """The real model, straight from its GGUF file, with the continued-pretraining preset: the loss at the first step
    is a pretrained model's (not ln(49152) = 10.8 of random weights), and final/ keeps the family, the GGUF's
    tokenizer.json and its chat template; another tokenizer than the GGUF's is refused before compute."""
    text = tmp_path / "domain.txt"
    text.write_text(CORPUS.read_text()[:20_000])
    preset = ROOT / "configs" / "pretrain" / "smollm2-continue.yaml"
    overrides = [
        f"data.source=[{text}]", f"data.out_dir={tmp_path / 'data'}", f"run.out_dir={tmp_path / 'runs'}",
        f"init.checkpoint={smollm2.gguf}", "loader.seq_len=32", "loader.micro_batch_size=1", "loader.val_batches=1",
        "trainer.max_steps=2", "trainer.val_every_n_steps=2", "optim.warmup_steps=0", "logger.kind=csv",
        "sample.prompt=",
    ]  # fmt: skip
    refused = load_config(PretrainConfig, preset, [*overrides, "data.tokenizer=default"])
    with pytest.raises(ConfigError, match="carries its tokenizer"):
        resolve_stage_tokenizer(refused, *stage_named("pretrain").model_folders(refused))

    assert lantern(["prepare", str(preset), *overrides]) == 0
    config = load_config(PretrainConfig, preset, overrides)
    run_dir = run_pretrain(config)
    assert config.data.tokenizer.endswith("tokenizer.json") and config.model.vocab_size == 49152
    rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    first_loss = next(float(value) for metric, _, value in rows if metric == "train/loss")
    assert first_loss < 6.0, first_loss
    final = run_dir / "final"
    info = json.loads((final / "lantern.json").read_text())
    assert info["model"]["hf_architecture"] == "LlamaForCausalLM" and info["model"]["dim"] == 576
    assert "chat_template" in json.loads((final / "tokenizer_config.json").read_text())
    assert load_tokenizer(final).fingerprint == load_tokenizer(config.data.tokenizer).fingerprint
