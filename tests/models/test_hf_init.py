"""Fine-tuning with LoRA straight from a Hugging Face or a Meta checkpoint folder (``init.checkpoint=PATH``): the
run loads it, its final model is the base plus the merged adapters (every other weight untouched, each adapted one
moved by a matrix of rank <= peft.rank), and its adapters, exported for peft, apply to the user's own Hugging Face
model. The tokenizer is ``data.tokenizer``; a folder that carries one (``tokenizer.model``, or
``original/tokenizer.model`` as Llama 3's Hugging Face repos) must be used with that one, and a mismatch is one line
that names the setting to write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel

from alignment.commands.cli import main
from alignment.stages.sft import run_sft
from data.demo.tasks import write_demo_dataset
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import detect_format, load_checkpoint
from models.model import ModelConfig, Transformer
from models.model_config import LORA_TARGETS
from tests.alignment.test_sft import ROOT, sft_config
from trainer.export import export_training_checkpoint

RANK = 4
TOL = 1e-4
QUICK = (
    "peft.kind=lora", f"peft.rank={RANK}", "trainer.max_steps=2", "trainer.val_every_n_steps=100",
    "eval.generations=0", "optim.lr=5e-2", "optim.warmup_steps=0", "optim.min_lr=0", "checkpoint.every_n_steps=2",
)  # fmt: skip


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    return write_demo_dataset(tmp_path_factory.mktemp("demo"), n_train=60, n_val=8, n_pairs=2, seed=0)


def other_tokenizer(path: Path) -> Path:
    """A valid rank file of the default tokenizer's size that is another tokenizer (two tokens swap ids)."""
    lines = Path(Tokenizer.load("default").path).read_bytes().splitlines()
    (a, rank_a), (b, rank_b) = lines[300].split(), lines[301].split()
    lines[300], lines[301] = b + b" " + rank_a, a + b" " + rank_b
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def hf_folder(path: Path) -> Path:
    """A tiny random ``LlamaForCausalLM`` as transformers saves it, with a tokenizer in ``original/`` (Llama 3's
    layout)."""
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    other_tokenizer(path / "original" / "tokenizer.model")
    return path


def meta_folder(path: Path) -> Path:
    """A tiny Meta consolidated folder (params.json, consolidated.00.pth, tokenizer.model)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32))
    path.mkdir(parents=True)
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 4096, "multiple_of": 32,
              "ffn_dim_multiplier": None, "norm_eps": 1e-5, "rope_theta": 500000.0}  # fmt: skip
    (path / "params.json").write_text(json.dumps(params))
    torch.save(model.state_dict(), path / "consolidated.00.pth")
    other_tokenizer(path / "tokenizer.model")
    return path


FOLDERS = {"hf": hf_folder, "meta": meta_folder}


@pytest.mark.parametrize("fmt", ["hf", "meta"])
def test_lora_sft_from_a_checkpoint_folder_merges_only_the_adapters(demo, tmp_path, fmt):
    base_dir = FOLDERS[fmt](tmp_path / fmt)
    assert detect_format(base_dir) == fmt
    run = run_sft(
        sft_config(demo, tmp_path / "runs", f"init.checkpoint={base_dir}", f"data.tokenizer={base_dir}", *QUICK)
    )
    base = load_checkpoint(base_dir, dtype=torch.float32).state_dict()
    final = load_checkpoint(run / "final").state_dict()
    assert final.keys() == base.keys()
    adapted = [name for name in base if name.rsplit(".", 2)[-2] in LORA_TARGETS]
    assert len(adapted) == 2 * len(LORA_TARGETS)
    for name, tensor in base.items():
        if name not in adapted:
            assert torch.equal(final[name], tensor), name
        else:  # the merged adapter: B @ A * alpha / rank
            delta = final[name].double() - tensor.double()
            assert 0 < torch.linalg.matrix_rank(delta, atol=1e-6) <= RANK, name
    # the run's checkpoint names the folder as its base, and its merged export is final/
    checkpoint = sorted((run / "checkpoints").glob("step-*.ckpt"))[-1]
    record = torch.load(checkpoint, weights_only=True)["adapters"]["model"]
    assert record["checkpoint"] == str(base_dir.resolve())
    merged = load_checkpoint(export_training_checkpoint(checkpoint, tmp_path / "merged")).state_dict()
    assert all(torch.equal(merged[name], final[name]) for name in final)


def test_the_exported_adapter_applies_to_the_users_own_hugging_face_model(demo, tmp_path):
    base_dir = hf_folder(tmp_path / "hf")
    run = run_sft(
        sft_config(demo, tmp_path / "runs", f"init.checkpoint={base_dir}", f"data.tokenizer={base_dir}", *QUICK)
    )
    checkpoint = sorted((run / "checkpoints").glob("step-*.ckpt"))[-1]
    assert main(["export", str(checkpoint), str(tmp_path / "export"), "--adapter"]) == 0
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = load_checkpoint(run / "final").eval()(ids)
        hf = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()  # the original
        assert (hf(ids).logits - expected).abs().max() > 1e-3
        tuned = PeftModel.from_pretrained(hf, tmp_path / "export" / "adapter").eval()
        assert (tuned(ids).logits - expected).abs().max().item() <= TOL
    # and the export's own tokenizer is the folder's, which the run trained with
    exported = tmp_path / "export" / "base" / "original" / "tokenizer.model"
    assert exported.read_bytes() == (base_dir / "original" / "tokenizer.model").read_bytes()


def test_a_folder_with_another_tokenizer_than_data_tokenizer_is_one_line(demo, tmp_path, capsys):
    base_dir = hf_folder(tmp_path / "hf")
    config = str(ROOT / "configs/sft/tiny.yaml")
    overrides = [f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]", f"run.out_dir={tmp_path / 'runs'}"]
    overrides.append("data.tokenizer=default")  # not the folder's own (data.tokenizer: auto would read that one)
    assert main(["sft", config, *overrides, "logger.kind=none", f"init.checkpoint={base_dir}", *QUICK]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert not any("Traceback" in line or "Logging error" in line for line in err)
    tokenizer = base_dir / "original" / "tokenizer.model"
    assert err[-1].startswith("lantern sft: error: ") and f"set data.tokenizer={tokenizer}" in err[-1]
    assert not (tmp_path / "runs").exists()  # refused before the run folder is made


def test_a_folder_without_a_tokenizer_must_name_one(demo, tmp_path, capsys):
    """A Hugging Face folder with weights only carries no tokenizer: the bundled default tokenizer would fit its
    vocabulary and map every id to another token, so data.tokenizer must be named."""
    base_dir = hf_folder(tmp_path / "hf")
    (base_dir / "original" / "tokenizer.model").unlink()
    config = str(ROOT / "configs/sft/tiny.yaml")
    overrides = [f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]", f"run.out_dir={tmp_path / 'runs'}"]
    assert main(["sft", config, *overrides, "logger.kind=none", f"init.checkpoint={base_dir}", *QUICK]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "carries no tokenizer" in err[-1] and "set data.tokenizer" in err[-1]
    assert not (tmp_path / "runs").exists()


def test_a_sentencepiece_model_is_named_as_one(tmp_path):
    """Llama 2's tokenizer.model is a sentencepiece protobuf, not a tiktoken rank file: one line saying so, without
    its bytes."""
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02\n\xff\xfe\x80")
    with pytest.raises(ValueError, match="not a tiktoken rank file") as error:
        Tokenizer.from_file(path)
    assert "\\x" not in str(error.value) and "\n" not in str(error.value)
