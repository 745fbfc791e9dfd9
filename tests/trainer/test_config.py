import pytest

from alignment.schemas.pretrain import PretrainConfig
from models.errors import ConfigError
from trainer.config import load_config, to_yaml

SHAKESPEARE = "configs/pretrain/shakespeare.yaml"


def test_presets_load_and_model_preset_expands():
    config = load_config(PretrainConfig, SHAKESPEARE)
    assert config.model.dim == 512 and config.model.n_layers == 6
    big = load_config(PretrainConfig, "configs/pretrain/llama3.2-1b.yaml")
    assert big.model.hidden_dim == 8192 and big.trainer.strategy == "fsdp"
    assert big.trainer.activation_checkpointing == "full" and big.trainer.precision == "bf16-mixed"


def test_overrides_are_typed_and_model_can_be_swapped():
    config = load_config(
        PretrainConfig, SHAKESPEARE, ["trainer.max_steps=7", "model=tiny", "model.n_layers=3", "optim.betas=[0.9,0.99]"]
    )
    assert config.trainer.max_steps == 7
    assert config.model.dim == 128 and config.model.n_layers == 3
    assert config.optim.betas == [0.9, 0.99]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.max_stepz=3", "trainer.max_stepz.*Did you mean.*max_steps"),
        ("optim.lr=abc", "optim.lr"),
        ("trainer.strategy=fsdp3", "trainer.strategy.*single"),
        ("trainer.precision=fp8", "trainer.precision"),
        ("model.dim=65", "model.dim"),
        ("model=no-such", "model preset 'no-such' not found"),
        ("no_equals_sign", "key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(PretrainConfig, SHAKESPEARE, [override])


def test_unknown_key_in_file_names_file_and_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("loader:\n  seq_len: 64\n  micro_batch: 4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*loader.micro_batch.*micro_batch_size"):
        load_config(PretrainConfig, path)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("run:\n  name: x\n loader: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml.*line 3"):
        load_config(PretrainConfig, path)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PretrainConfig, "configs/nope.yaml")


def test_yaml_round_trip(tmp_path):
    config = load_config(PretrainConfig, SHAKESPEARE, ["model.rope_scaling={factor: 8.0}"])
    path = tmp_path / "saved.yaml"
    path.write_text(to_yaml(config))
    assert load_config(PretrainConfig, path) == config


def test_configs_never_execute_code(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("run:\n  name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError):
        load_config(PretrainConfig, path)
