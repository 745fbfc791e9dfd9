"""Bad checkpoints and the CLI's error contract: a truncated, corrupt, foreign, pickled or mis-shaped
checkpoint is one line naming the file and what is wrong (never torch's advice to load with
``weights_only=False``), and ``lantern`` prints every expected error as ``lantern CMD: error: ...`` with exit
code 2 and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from alignment.commands.cli import main
from models.errors import CheckpointError
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.formats.hf_format import read_hf_weights
from models.heads import HEAD_WEIGHTS, ScalarModel, load_scalar_model, save_scalar_model
from models.model import ModelConfig, Transformer
from tests.helpers import subprocess_env
from trainer.export import read_training_checkpoint

ROOT = Path(__file__).resolve().parents[2]


class Payload:
    """Pickled into a checkpoint: weights_only loading must refuse it, not run or construct it."""


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny"))
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "tiny")


def copy_of(native: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    copy.mkdir()
    for item in native.iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    return copy


def assert_one_line(error: BaseException, *needles: str) -> None:
    text = str(error)
    assert "\n" not in text, text
    assert "weights_only=False" not in text and "weights_only` set to `False" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)


def test_truncated_safetensors_names_the_file(native, tmp_path):
    folder = copy_of(native, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert_one_line(caught.value, str(weights), "truncated or corrupt")


def test_garbage_weights_file_names_the_file(native, tmp_path):
    folder = copy_of(native, tmp_path)
    (folder / "model.safetensors").write_bytes(b"this is not a tensor file\n" * 50)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert_one_line(caught.value, str(folder / "model.safetensors"), "corrupt")


def test_foreign_json_is_not_a_lantern_checkpoint(native, tmp_path):
    folder = copy_of(native, tmp_path)
    (folder / "lantern.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert_one_line(caught.value, "lantern.json", "expected 'lantern'")


def test_lantern_json_without_model_section(native, tmp_path):
    folder = copy_of(native, tmp_path)
    info = json.loads((folder / "lantern.json").read_text())
    del info["model"]
    (folder / "lantern.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert_one_line(caught.value, "lantern.json", "no 'model' section")


def test_shape_mismatch_names_key_and_both_shapes(native, tmp_path):
    folder = copy_of(native, tmp_path)
    state = load_file(folder / "model.safetensors")
    state["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(64, 128)  # Hugging Face's names in the file
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert_one_line(caught.value, str(folder), "layers.1.attention.wq.weight: checkpoint (64, 128) vs model (128, 128)")


def test_wrong_model_lists_a_bounded_number_of_keys(native, tmp_path):
    """Weights of another model: hundreds of keys could be wrong; the line stays readable."""
    folder = copy_of(native, tmp_path)
    info = json.loads((folder / "lantern.json").read_text())
    info["model"]["n_layers"] = 40
    (folder / "lantern.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert_one_line(caught.value, "missing keys (324)", "... 316 more]")
    assert len(str(caught.value)) < 1500


def test_pickled_hf_weights_are_refused_without_running_them(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as caught:
        read_hf_weights(folder)
    assert_one_line(caught.value, str(folder / "pytorch_model.bin"), "refused", "Payload")


def test_truncated_training_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "step-00000002.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError) as caught:
        read_training_checkpoint(path)
    assert_one_line(caught.value, str(path), "truncated or corrupt")


def test_pickled_training_checkpoint_is_refused(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "extra": Payload()}, path)
    with pytest.raises(CheckpointError) as caught:
        read_training_checkpoint(path)
    assert_one_line(caught.value, str(path), "refused")


def test_non_dict_training_checkpoint(tmp_path):
    path = tmp_path / "tensor.ckpt"
    torch.save(torch.zeros(3), path)
    with pytest.raises(CheckpointError) as caught:
        read_training_checkpoint(path)
    assert_one_line(caught.value, str(path), "not a training checkpoint")


def test_reward_model_head_truncated_or_mis_shaped(tmp_path):
    torch.manual_seed(0)
    folder = save_scalar_model(ScalarModel(ModelConfig.from_preset("tiny")), tmp_path / "rm")
    head = folder / HEAD_WEIGHTS
    save_file({"proj.weight": torch.zeros(1, 64), "proj.bias": torch.zeros(1)}, head)
    with pytest.raises(CheckpointError) as caught:
        load_scalar_model(folder)
    assert_one_line(caught.value, str(head), "checkpoint (1, 64) vs model (1, 128)")
    head.write_bytes(head.read_bytes()[:40])
    with pytest.raises(CheckpointError) as caught:
        load_scalar_model(folder)
    assert_one_line(caught.value, str(head), "truncated or corrupt")


# ---- the CLI's contract: one line, exit code 2, no traceback


def test_cli_prints_a_checkpoint_error_as_one_line(native, tmp_path, capsys):
    folder = copy_of(native, tmp_path)
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    code = main(["generate", "--checkpoint", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("lantern generate: error: ") and str(folder / "model.safetensors") in err[-1]
    assert not any("Traceback" in line for line in err)


def test_cli_export_of_a_pickle_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "extra": Payload()}, path)
    assert main(["export", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused" in err and "weights_only" not in err
    assert not (tmp_path / "out").exists()


def test_cli_config_error_in_a_fresh_process_has_no_traceback(tmp_path):
    """The installed entry point, end to end: a wrong key is one stderr line and exit code 2."""
    env = subprocess_env()
    command = [
        sys.executable,
        "-m",
        "alignment.commands.cli",
        "pretrain",
        str(ROOT / "configs/pretrain/tiny.yaml"),
        "optim.lr=-1",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("lantern pretrain: error: ")
    assert "optim.lr must be > 0 but got -1" in lines[-1]


def test_cli_os_error_is_one_line(tmp_path, capsys):
    """An OSError (here: a corpus file that does not exist) is the user's to fix, not a traceback."""
    code = main(
        [
            "tokenizer",
            "train",
            "--corpus",
            str(tmp_path / "missing.txt"),
            "--vocab-size",
            "600",
            "--out",
            str(tmp_path / "t.tiktoken"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "missing.txt" in err


def test_random_bytes_are_called_corrupt_not_a_dangerous_pickle(tmp_path):
    """Bytes the weights-only unpickler cannot parse are damage; "refused ... could run arbitrary code" is kept
    for pickles that really name Python objects."""
    path = tmp_path / "noise.ckpt"
    path.write_bytes(bytes(range(7, 107)))  # not a zip, and opcode 7 is not a pickle opcode
    with pytest.raises(CheckpointError) as caught:
        read_training_checkpoint(path)
    assert_one_line(caught.value, str(path), "truncated or corrupt")
    assert "refused" not in str(caught.value) and "weights_only" not in str(caught.value)


def test_export_of_a_reward_model_or_a_full_weight_rl_checkpoint(tmp_path, capsys):
    """Before: a reward model's .ckpt printed a ~6 KB line of missing and unexpected keys (export, eval); a
    full-weight GRPO/PPO .ckpt a `KeyError: 'model'` traceback (RL configs have no model section: the policy's
    folder is its model). Now: one line for the reward model (its run's final/ is its export), and the RL policy
    exported with the model of its init.policy folder (one line when that folder is gone)."""
    from data.tokenizer.tokenizer import Tokenizer

    config = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=4096, max_seq_len=32)
    torch.manual_seed(0)
    policy = Transformer(config)
    start = save_checkpoint(policy, tmp_path / "sft-final", tokenizer_path=Tokenizer.load().path)
    reward = ScalarModel.from_backbone(Transformer(config))
    rm_ckpt, rl_ckpt = tmp_path / "rm.ckpt", tmp_path / "grpo.ckpt"
    torch.save({
        "hyper_parameters": {"config": {"model": config.to_dict(), "data": {"tokenizer": "default"}}},
        "state_dict": {f"model.{k}": v for k, v in reward.state_dict().items()}, "global_step": 2,
    }, rm_ckpt)  # fmt: skip
    torch.save({
        "hyper_parameters": {"config": {"init": {"policy": str(start)}, "tokenizer": "default"}},
        "state_dict": {f"model.{k}": v for k, v in policy.state_dict().items()}, "global_step": 2,
    }, rl_ckpt)  # fmt: skip

    for command in (
        ["export", str(rm_ckpt), str(tmp_path / "rm-out")],
        ["eval", str(rm_ckpt), "--tasks", "lantern_demo_choice", "--out", str(tmp_path / "ev")],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert f"{rm_ckpt} is a reward model's checkpoint (a backbone and a score head)" in err, err
        assert len(err) < 400 and "\n" not in err, err

    assert main(["export", str(rl_ckpt), str(tmp_path / "policy")]) == 0
    exported = load_checkpoint(tmp_path / "policy")
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in policy.state_dict().items())
    capsys.readouterr()
    start.rename(tmp_path / "moved")
    assert main(["export", str(rl_ckpt), str(tmp_path / "policy-2")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"its model is that of init.policy, {start}, which cannot be read now" in err and "\n" not in err, err
