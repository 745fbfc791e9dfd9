"""A tokenizer and a checkpoint that do not fit each other are refused before any compute, by the one check every
command that pairs them makes (trainer/checks.py ``check_model_tokenizer``: every stage through
``check_stage_config``, ``lantern generate``), and a tokenizer.json is read as one whatever name it was saved under.

Fixtures are tiny: a one-layer model saved with ``save_checkpoint`` and a ~300-token byte-level BPE written with the
``tokenizers`` library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignment.commands.cli import main
from alignment.schemas.dpo import DPOConfig
from alignment.schemas.rejection_sampling import RejectionSamplingConfig
from alignment.schemas.reward import RMConfig
from alignment.schemas.rl import GRPOConfig, PPOConfig
from alignment.schemas.sft import SFTConfig
from alignment.stages.registry import stage_named
from data.demo.tasks import write_demo_dataset
from data.tokenizer.base import load_tokenizer
from data.tokenizer.hf import HFTokenizer
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError
from models.formats.checkpoint import save_checkpoint
from models.model import ModelConfig, Transformer
from trainer.build import check_stage_config
from trainer.checks import check_model_tokenizer
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VOCAB = 4096  # the bundled tokenizer's


def tiny_model(vocab_size: int) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, multiple_of=32, max_seq_len=256
    )
    return Transformer(config)


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer.json (non-ASCII in its vocabulary, as every GPT-2 style one) and its
    tokenizer_config.json."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    return write_demo_dataset(tmp_path_factory.mktemp("demo"), n_train=20, n_val=4, n_pairs=2, seed=0)


def error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err  # one line, no traceback
    return err[0]


def refuse_weights(monkeypatch) -> None:
    """Any weight read fails the test: the check must come before."""

    def read(*args, **kwargs):
        raise AssertionError("weights were read before the tokenizer was checked")

    monkeypatch.setattr("models.formats.checkpoint.load_checkpoint", read)


# ---- a folder without a tokenizer: no silent fallback to the bundled default


def test_sft_refuses_a_native_folder_without_a_tokenizer_whose_vocabulary_is_not_the_defaults(demo, tmp_path, capsys):
    """`lantern convert` of a Hugging Face folder without a tokenizer gives a native folder without one: SFT from
    it trained with the bundled 4,096-token tokenizer and exited 0."""
    folder = save_checkpoint(tiny_model(DEFAULT_VOCAB + 904), tmp_path / "converted")
    overrides = [
        f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]", f"run.out_dir={tmp_path / 'runs'}",
        "logger.kind=none", f"init.checkpoint={folder}", "trainer.max_steps=1", "eval.generations=0",
        "optim.warmup_steps=0", "checkpoint.every_n_steps=1",
    ]  # fmt: skip
    assert main(["sft", str(ROOT / "configs/sft/tiny.yaml"), *overrides]) == 2
    line = error_line(capsys)
    assert line.startswith("lantern sft: error: ") and f"{folder} carries no tokenizer" in line
    assert "vocab_size (5000)" in line and f"({DEFAULT_VOCAB})" in line and "set data.tokenizer=" in line
    assert not (tmp_path / "runs").exists()  # before the run folder, let alone any step


STAGES = {
    "sft": (SFTConfig, "configs/sft/tiny.yaml", "init.checkpoint"),
    "rm": (RMConfig, "configs/rm/tiny.yaml", "init.checkpoint"),
    "dpo": (DPOConfig, "configs/dpo/tiny.yaml", "init.policy"),
    "ppo": (PPOConfig, "configs/ppo/tiny.yaml", "init.policy"),
    "grpo": (GRPOConfig, "configs/grpo/tiny.yaml", "init.policy"),
    "rejection-sampling": (RejectionSamplingConfig, "configs/rejection_sampling/tiny.yaml", "init.policy"),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_checks_the_pair_in_its_first_check(stage, bpe_json, tmp_path):
    """check_stage_config, every stage's first call: a folder without a tokenizer of another size than the
    default is refused, one whose tokenizer has more ids than its embeddings too (both sizes and both named), and
    a padded embedding (more rows than the tokenizer's ids) is fine, with data.tokenizer the folder's own."""
    schema, path, key = STAGES[stage]

    def checked(folder: Path) -> object:
        config = load_config(schema, ROOT / path, [f"{key}={folder}", f"run.out_dir={tmp_path / 'runs'}"])
        folders = stage_named(stage).model_folders(config)  # the folders its record declares
        check_stage_config(config, folders, getattr(config, "sft", config).trainer)  # rejection sampling: its sft's
        return config

    bare = save_checkpoint(tiny_model(DEFAULT_VOCAB + 904), tmp_path / "bare")
    with pytest.raises(ConfigError, match="carries no tokenizer") as caught:
        checked(bare)
    assert str(bare) in str(caught.value) and "set data.tokenizer=" in str(caught.value)

    n = load_tokenizer(bpe_json).vocab_size
    small = save_checkpoint(tiny_model(n - 50), tmp_path / "small", tokenizer_path=bpe_json)
    with pytest.raises(ConfigError) as caught:
        checked(small)
    message = str(caught.value)
    assert f"{small / 'tokenizer.json'} has {n} tokens" in message and f"{small} has vocab_size {n - 50}" in message
    assert "set data.tokenizer=" in message and "model.vocab_size" not in message  # a checkpoint's is fixed

    padded = save_checkpoint(tiny_model(n + 64), tmp_path / "padded", tokenizer_path=bpe_json)
    assert checked(padded).data.tokenizer == str((padded / "tokenizer.json").absolute())


# ---- lantern generate


def test_generate_refuses_a_folder_without_a_tokenizer_before_reading_its_weights(tmp_path, capsys, monkeypatch):
    """It sampled ids past the bundled tokenizer's and crashed decoding them (KeyError: 'Invalid token for
    decoding')."""
    folder = save_checkpoint(tiny_model(DEFAULT_VOCAB + 904), tmp_path / "converted")
    refuse_weights(monkeypatch)
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "hi", "--max-new-tokens", "8"]) == 2
    line = error_line(capsys)
    assert f"{folder} carries no tokenizer" in line and "pass --tokenizer " in line


def test_generate_names_both_sizes_and_an_option_it_has(tmp_path, capsys, monkeypatch):
    """A tokenizer larger than the model's vocabulary: the error said to set model.vocab_size, which generate has
    no way to set."""
    folder = save_checkpoint(tiny_model(1000), tmp_path / "m")
    refuse_weights(monkeypatch)
    args = ["generate", "--checkpoint", str(folder), "--tokenizer", "default", "--prompt", "hi"]
    assert main(args) == 2
    line = error_line(capsys)
    default = Tokenizer.load("default").path
    assert f"tokenizer {default} has {DEFAULT_VOCAB} tokens but {folder} has vocab_size 1000" in line
    assert "pass --tokenizer " in line and "model.vocab_size" not in line


def test_generate_uses_the_folders_own_tokenizer_json(bpe_json, tmp_path, capsys):
    """A folder saved with a tokenizer.json path (``tokenizer_path=``) had it copied as tokenizer.model, then read
    as a tiktoken rank file: "binary content: a sentencepiece model"."""
    # exactly the tokenizer's ids: a random model's padded rows could be sampled, which no tokenizer decodes
    folder = save_checkpoint(tiny_model(load_tokenizer(bpe_json).vocab_size), tmp_path / "m", tokenizer_path=bpe_json)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    assert not (folder / "tokenizer.model").exists()
    args = ["generate", "--checkpoint", str(folder), "--prompt", "hello", "--max-new-tokens", "4"]
    assert main([*args, "--temperature", "0", "--no-heal"]) == 0
    assert capsys.readouterr().out.startswith("hello")


# ---- reading a tokenizer.json, whatever its name


def test_a_tokenizer_json_is_read_as_one_whatever_its_name(bpe_json, tmp_path):
    """The kind of a tokenizer file is its name when it ends in .json, else its content: a tokenizer.json saved as
    tokenizer.model (by the old writer) is a Hugging Face tokenizer, not a "sentencepiece model"."""
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(bpe_json.read_bytes())
    (folder / "tokenizer_config.json").write_bytes((bpe_json.parent / "tokenizer_config.json").read_bytes())
    tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.fingerprint == load_tokenizer(bpe_json).fingerprint
    assert set(tokenizer.files) == {"tokenizer.json", "tokenizer_config.json"}  # travels on under its own name
    assert isinstance(load_tokenizer(bpe_json), HFTokenizer)
    with pytest.raises(ValueError, match="is a Hugging Face tokenizer.json") as caught:
        Tokenizer.from_file(folder / "tokenizer.model")
    assert "sentencepiece" not in str(caught.value)


def test_another_tokenizer_put_beside_a_models_weights_is_refused(tmp_path, capsys):
    """Before: a 4,096-token tokenizer.json placed beside SmolLM2's weights (49,152 ids) went unnoticed: `lantern
    generate` printed garbage and LoRA SFT trained, both exit 0. The tokenizer files a folder was saved with are
    recorded (sha256 in lantern.json); here another rank file of the same size (two tokens' ids swapped, so every
    text encodes otherwise) is refused by generate and by a stage starting from the folder, naming the file."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=4096, max_seq_len=32))
    folder = save_checkpoint(model, tmp_path / "model", tokenizer_path=Tokenizer.load("default").path)
    rank_file = folder / "tokenizer.model"
    lines = rank_file.read_text().splitlines()
    a, b = lines[300].split(), lines[301].split()
    lines[300], lines[301] = f"{b[0]} {a[1]}", f"{a[0]} {b[1]}"  # two tokens trade ids
    rank_file.write_text("\n".join(lines) + "\n")
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "KING:", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lantern generate: error: {rank_file} is not the one its weights were saved with"), err
    assert "\n" not in err
    with pytest.raises(ConfigError, match=f"{rank_file} is not the one its weights were saved with"):
        check_model_tokenizer("auto", model.config, folder, key="data.tokenizer")
