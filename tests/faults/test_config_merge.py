"""Issue 31: what a config's model is, and how a config file is read.

- A model given by name or file (``model=NAME``, ``model=PATH.yaml``, a pipeline's ``sft.model=...``, rejection
  sampling's ``sft.model``) replaces the section: it is that preset, never its shape merged into the file's other model
  keys; ``model.KEY=V`` changes one key; keys a model section omits take ModelConfig's defaults (derived ones derived).
- An absurd model size is a one-line error naming the key before anything is built (the plan used to build a meta
  model of 10^12 layers, for ever).
- A YAML key given twice is one line naming the file, the line and the key, whichever command reads it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from alignment.commands.cli import main
from alignment.commands.pipeline import Pipeline, load_pipeline_config
from alignment.schemas.pretrain import PretrainConfig
from alignment.schemas.rejection_sampling import RejectionSamplingConfig
from models.errors import ConfigError
from models.model import ModelConfig
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
LLAMA_1B = str(ROOT / "configs/pretrain/llama3.2-1b.yaml")
TINY = str(ROOT / "configs/pretrain/tiny.yaml")
# Meta's params.json for Llama 2 13B: plain multi-head attention (no n_kv_heads), no tied embeddings, no RoPE scaling,
# none of which a merge into the 1B preset's model section would leave alone (it came out as 17.1B)
LLAMA2_13B = "dim: 5120\nn_layers: 40\nn_heads: 40\nvocab_size: 32000\nmultiple_of: 256\nnorm_eps: 1.0e-5\n"
LLAMA2_13B += "rope_theta: 10000.0\nmax_seq_len: 4096\n"


class StillRunning(Exception):
    """Not an OSError (TimeoutError is one): ``main`` would print it as a user's error, and the test could pass."""


@contextmanager
def at_most(seconds: int) -> Iterator[None]:
    """Fail, rather than hang, when the block runs longer than ``seconds``."""

    def expire(*_: object) -> None:
        raise StillRunning(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_error_line(capsys: pytest.CaptureFixture[str], command: str, *args: str) -> str:
    with at_most(120):
        assert main([command, *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


# ---- a model by name or file replaces the section


def test_a_model_by_name_over_a_preset_is_that_preset():
    config = load_config(PretrainConfig, LLAMA_1B, ["model=tiny"])
    assert config.model == ModelConfig.from_preset("tiny")  # not tiny's shape with the 1B's tied embeddings and RoPE
    assert config.model.num_params() == ModelConfig.from_preset("tiny").num_params()


def test_a_model_by_file_over_a_preset_is_that_file(tmp_path):
    path = tmp_path / "llama2-13b.yaml"
    path.write_text(LLAMA2_13B)
    model = load_config(PretrainConfig, LLAMA_1B, [f"model={path}"]).model
    assert model == ModelConfig.from_preset(str(path))
    assert model.n_kv_heads == 40 and not model.tie_embeddings and model.rope_scaling is None
    assert round(model.num_params() / 1e9, 1) == 13.0


def test_plan_model_name_plans_what_dash_dash_model_plans(capsys):
    rows = "loader.seq_len=256"  # within tiny's context: the plan refuses rows the model cannot hold, as the run does
    main(["plan", LLAMA_1B, "model=tiny", rows, "--json"])
    by_override = capsys.readouterr().out
    main(["plan", LLAMA_1B, "--model", "tiny", rows, "--json"])
    by_flag = capsys.readouterr().out
    assert '"model": "1.84M parameters' in by_override
    assert by_override == by_flag


def test_model_key_overrides_change_one_key_and_later_ones_win():
    base = ModelConfig.from_preset("llama3.2-1b")
    model = load_config(PretrainConfig, LLAMA_1B, ["model.n_layers=2"]).model
    assert model == ModelConfig.from_preset("llama3.2-1b", n_layers=2)  # the rest of the preset kept
    assert model.tie_embeddings and model.rope_scaling == base.rope_scaling
    # the command line reads left to right: a whole model given after a key replaces it, a key after it changes it
    assert load_config(PretrainConfig, LLAMA_1B, ["model.n_layers=2", "model=tiny"]).model.n_layers == 4
    assert load_config(PretrainConfig, LLAMA_1B, ["model=tiny", "model.n_layers=2"]).model.n_layers == 2


def test_keys_a_model_section_omits_take_model_config_defaults_derived_from_its_own_keys(tmp_path):
    # n_kv_heads defaults to n_heads: the schema's default model (8 heads) must not leave grouped-query attention over 8
    # key/value heads behind when only n_heads is given
    assert load_config(PretrainConfig, None, ["model.n_heads=16"]).model.n_kv_heads == 16
    path = tmp_path / "mha.yaml"
    path.write_text("dim: 256\nn_layers: 2\nn_heads: 4\n")
    assert load_config(PretrainConfig, TINY, [f"model={path}"]).model == ModelConfig.from_preset(str(path))


def test_a_stage_model_in_a_pipeline_replaces_the_stage_preset_model(tmp_path):
    stage = tmp_path / "sft.yaml"
    stage.write_text((ROOT / "configs/sft/tiny.yaml").read_text().replace("model: tiny", "model: llama3.2-1b"))
    overrides = [f"out_dir={tmp_path / 'pipeline'}", "stages=[sft]", f"sft.config={stage}", "sft.model=tiny"]
    pipeline = Pipeline(load_pipeline_config(str(ROOT / "configs/pipeline/tiny.yaml"), overrides))
    pipeline.demo_hash = "test"
    config, _ = pipeline.load_stage_config("sft")
    assert config.model == ModelConfig.from_preset("tiny")


def test_a_nested_model_section_takes_a_name_in_the_file_and_on_the_command_line(tmp_path):
    path = tmp_path / "rs.yaml"
    text = (ROOT / "configs/rejection_sampling/tiny.yaml").read_text()
    path.write_text(text.replace("sft:\n", "sft:\n  model: llama3.2-1b\n", 1))
    assert load_config(RejectionSamplingConfig, path).sft.model == ModelConfig.from_preset("llama3.2-1b")
    assert load_config(RejectionSamplingConfig, path, ["sft.model=tiny"]).sft.model == ModelConfig.from_preset("tiny")


# ---- absurd model sizes


HUGE = 10**12


@pytest.mark.parametrize(
    ("key", "overrides"),
    [
        pytest.param("n_layers", [f"model.n_layers={HUGE}"], id="n_layers"),
        # built, 2^80 elements: an overflow, not a plan
        pytest.param("dim", [f"model.dim={2**40}", "model.n_heads=4"], id="dim"),
        pytest.param("n_heads", [f"model.dim={2**16}", f"model.n_heads={2**15}", "model.n_kv_heads=1"], id="n_heads"),
        pytest.param("vocab_size", [f"model.vocab_size={HUGE}"], id="vocab_size"),
        pytest.param("max_seq_len", [f"model.max_seq_len={HUGE}"], id="max_seq_len"),
        pytest.param("ffn_hidden_dim", [f"model.ffn_hidden_dim={HUGE}"], id="ffn_hidden_dim"),
        pytest.param("multiple_of", [f"model.multiple_of={HUGE}"], id="multiple_of"),
    ],
)
def test_an_absurd_model_size_is_a_config_error_naming_the_key(key, overrides):
    with pytest.raises(ConfigError, match=rf"model\.{key} must be in \[1, \d+\] but got"):
        load_config(PretrainConfig, TINY, overrides)


def test_plan_of_a_trillion_layers_is_one_line_not_a_hang(capsys, tmp_path):
    line = one_error_line(capsys, "plan", TINY, f"model.n_layers={HUGE}")
    assert "model.n_layers must be in [1, 1024] but got 1000000000000" in line
    huge = tmp_path / "huge.yaml"
    huge.write_text(f"dim: 128\nn_layers: {HUGE}\nn_heads: 4\n")
    line = one_error_line(capsys, "plan", TINY, "--model", str(huge))  # a model named outside the config: the same
    assert f"--model {huge}: model.n_layers must be in [1, 1024]" in line


# ---- a key given twice


DUPLICATE = "run:\n  name: first\nmodel: tiny\nrun:\n  name: second\n"


@pytest.mark.parametrize(
    "command",
    [["plan"], ["plan", "--stage", "sft"], ["sft"], ["pretrain"], ["prepare"], ["pipeline"]],
    ids=lambda command: " ".join(command),
)
def test_a_duplicate_key_is_one_line_naming_file_line_and_key(capsys, tmp_path, command):
    path = tmp_path / "config.yaml"
    path.write_text(DUPLICATE)
    line = one_error_line(capsys, command[0], str(path), *command[1:])
    assert f"{path}, line 4: duplicate key 'run' (first at line 1)" in line


def test_a_duplicate_key_in_a_model_file_is_named_too(capsys, tmp_path):
    model = tmp_path / "model.yaml"
    model.write_text("dim: 128\nn_layers: 2\nn_heads: 4\ndim: 64\n")
    expected = f"{model}, line 4: duplicate key 'dim' (first at line 1)"
    assert expected in one_error_line(capsys, "plan", TINY, f"model={model}")
    assert expected in one_error_line(capsys, "plan", TINY, "--model", str(model))
    nested = tmp_path / "nested.yaml"
    nested.write_text("run:\n  name: a\n  seed: 1\n  name: b\n")
    assert f"{nested}, line 4: duplicate key 'name' (first at line 2)" in one_error_line(
        capsys, "pretrain", str(nested)
    )
