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


# ---- optim: WSD and Muon (issue 46) ----


def test_benchmark_overrides_express_muon_and_wsd():
    """The benchmark's three arms on the shakespeare preset are overrides only."""
    muon = load_config(PretrainConfig, SHAKESPEARE, ["optim.name=muon", "optim.schedule=wsd"])
    assert (muon.optim.name, muon.optim.schedule, muon.optim.decay_shape) == ("muon", "wsd", "1-sqrt")
    assert muon.optim.muon.lr is None and muon.optim.muon.adjust_lr_fn == "match_rms_adamw"
    tuned = load_config(
        PretrainConfig,
        SHAKESPEARE,
        ["optim.name=muon", "optim.muon.lr=0.02", "optim.muon.adjust_lr_fn=original", "optim.decay_fraction=0.1",
         "optim.schedule=wsd", "optim.decay_shape=linear"],
    )  # fmt: skip
    assert tuned.optim.muon.lr == 0.02 and tuned.optim.decay_fraction == 0.1
    assert load_config(PretrainConfig, SHAKESPEARE, ["optim.schedule=wsd"]).optim.name == "adamw"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optim.name=sgd"], r"optim\.name.*adamw.*muon"),
        (["optim.schedule=wsd", "optim.decay_shape=cosine"], r"optim\.decay_shape"),
        (["optim.schedule=wsd", "optim.decay_steps=0"], r"optim\.decay_steps must be >= 1"),
        (["optim.schedule=wsd", "optim.decay_fraction=1.5"], r"optim\.decay_fraction must be in \(0, 1\] but got 1\.5"),
        (["optim.name=muon", "optim.muon.ns_steps=100"], r"optim\.muon\.ns_steps must be in \[1, 99\]"),
        (["optim.name=muon", "optim.muon.momentum=1"], r"optim\.muon\.momentum must be in \[0, 1\)"),
        (["optim.name=muon", "optim.muon.adjust_lr_fn=none"], r"optim\.muon\.adjust_lr_fn"),
        (
            ["optim.schedule=wsd", "optim.decay_steps=5", "optim.decay_fraction=0.1"],
            r"optim\.decay_steps \(5\) and optim\.decay_fraction \(0\.1\) both set .*: give one$",
        ),
        (["optim.decay_steps=5"], r"optim\.decay_steps sets the cooldown of optim\.schedule 'wsd'.*'cosine'$"),
        (["optim.schedule=constant", "optim.decay_fraction=0.3"], r"optim\.decay_fraction .*'constant'$"),
        (
            ["trainer.max_steps=100", "optim.warmup_steps=30", "optim.schedule=wsd", "optim.decay_steps=71"],
            r"optim\.warmup_steps \(30\) \+ the WSD cooldown \(71 steps, optim\.decay_steps\) exceed "
            r"trainer\.max_steps \(100\)",
        ),
        (
            ["trainer.max_steps=100", "optim.warmup_steps=30", "optim.schedule=wsd", "optim.decay_fraction=0.8"],
            r"cooldown \(80 steps, optim\.decay_fraction\) exceed trainer\.max_steps \(100\)",
        ),
        (
            ["optim.name=muon", "trainer.strategy=fsdp", "trainer.devices=2"],
            r"optim\.name 'muon' cannot run under trainer\.strategy 'fsdp': .*whole weight matrix.*shard",
        ),
    ],
)
def test_bad_optim_settings_are_one_line_at_load(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as error:
        load_config(PretrainConfig, SHAKESPEARE, overrides)
    assert "\n" not in str(error.value)


def test_wsd_fitting_exactly_and_muon_under_ddp_load():
    config = load_config(
        PretrainConfig,
        SHAKESPEARE,
        ["trainer.max_steps=100", "optim.warmup_steps=30", "optim.schedule=wsd", "optim.decay_steps=70",
         "optim.name=muon", "trainer.strategy=ddp", "trainer.devices=2"],
    )  # fmt: skip
    assert config.optim.decay_steps == 70  # no stable phase left, but warmup and cooldown fit


def test_muon_with_lora_and_the_critic_optimizer_are_refused_at_load():
    from alignment.schemas.rl import PPOConfig
    from alignment.schemas.sft import SFTConfig

    with pytest.raises(ConfigError, match=r"optim\.name 'muon' with peft\.kind 'lora': .*use optim\.name=adamw$"):
        load_config(SFTConfig, None, ["optim.name=muon", "peft.kind=lora"])
    with pytest.raises(ConfigError, match=r"critic_optim\.name 'muon' cannot run under trainer\.strategy 'fsdp'"):
        load_config(PPOConfig, None, ["critic_optim.name=muon", "trainer.strategy=fsdp", "trainer.devices=2"])


def test_rl_wsd_counts_optimizer_updates():
    """An RL stage's schedule spans its updates (max_steps x epochs x minibatches a rollout): a cooldown longer than
    trainer.max_steps but within the updates fits."""
    from alignment.schemas.rl import GRPOConfig

    base = ["trainer.max_steps=10", "grpo.prompts_per_rollout=8", "grpo.group_size=4", "grpo.minibatch_size=8"]
    config = load_config(GRPOConfig, None, [*base, "optim.schedule=wsd", "optim.decay_steps=30"])
    assert config.schedule_steps() == 10 * 1 * (32 // 8)
    with pytest.raises(ConfigError, match=r"cooldown \(41 steps, optim\.decay_steps\) exceed the run's 40 optimizer"):
        load_config(GRPOConfig, None, [*base, "optim.schedule=wsd", "optim.decay_steps=41"])
