"""GGUF files through the commands that read them (`convert --from gguf`, `eval`, `generate`): a truncated file, or
one of an architecture Lantern does not read, is one line naming the file, exit 2, from every command (before:
IndexError and struct.error tracebacks, or transformers' messages); and a tiny model written as GGUF reads back
with exactly its vocabulary (before: transformers' reader added GPT-2's "<|endoftext|>" as a 4,097th token, and
`lantern generate` refused the folder Lantern had just written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignment.commands.cli import main
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import save_checkpoint
from models.model import ModelConfig, Transformer
from tests.helpers import write_gpt2_gguf

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny native folder over the shipped tokenizer's 4,096 ids, the same model written as an f32 GGUF)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=64)
    )
    folder = save_checkpoint(model, root / "native", tokenizer_path=Tokenizer.load("default").path)
    assert main(["convert", str(folder), "--to", "gguf", str(root / "tiny.gguf"), "--dtype", "float32"]) == 0
    return folder, root / "tiny.gguf"


def commands(path: Path, out: Path) -> dict[str, list[str]]:
    return {
        "convert": ["convert", "--from", "gguf", str(path), "--to", "native", str(out)],
        "eval": ["eval", str(path), "--tasks", "lantern_demo_choice", "--limit", "2", "--out", str(out)],
        "generate": ["generate", "--checkpoint", str(path), "--prompt", "x", "--max-new-tokens", "2"],
    }


@pytest.mark.parametrize("cut", [100, 20_000, -4096], ids=["header", "vocabulary", "tensors"])
@pytest.mark.parametrize("command", ["convert", "eval", "generate"])
def test_a_truncated_gguf_is_one_line_naming_it_from_every_command(tiny_gguf, tmp_path, capsys, cut, command):
    data = tiny_gguf[1].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:cut])
    assert main(commands(truncated, tmp_path / "out")[command]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lantern {command}: error: {truncated}: ") and "\n" not in err, err
    assert "truncated or damaged" in err or "cannot" in err, err


@pytest.mark.parametrize("command", ["convert", "eval", "generate"])
def test_a_gguf_of_another_architecture_is_one_line_from_every_command(tmp_path, capsys, command):
    write_gpt2_gguf(tmp_path / "gpt2.gguf")
    assert main(commands(tmp_path / "gpt2.gguf", tmp_path / "out")[command]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lantern {command}: error: {tmp_path / 'gpt2.gguf'}: GGUF architecture 'gpt2' is not ")
    assert "\n" not in err, err


def test_a_tiny_model_through_gguf_and_back_keeps_its_vocabulary_and_generates(tiny_gguf, tmp_path, capsys):
    folder, path = tiny_gguf
    back = tmp_path / "back"
    assert main(["convert", "--from", "gguf", str(path), "--to", "native", str(back)]) == 0
    tokenizer = json.loads((back / "tokenizer.json").read_text())
    ids = [token["id"] for token in tokenizer["added_tokens"]] + list(tokenizer["model"]["vocab"].values())
    assert max(ids) == 4095 and len(set(ids)) == 4096
    capsys.readouterr()
    texts = []
    for source in (folder, back):
        assert (
            main(
                [
                    "generate",
                    "--checkpoint",
                    str(source),
                    "--prompt",
                    "KING:",
                    "--max-new-tokens",
                    "6",
                    "--temperature",
                    "0",
                ]
            )
            == 0
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
