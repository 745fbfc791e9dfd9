"""`lantern convert` between native, Hugging Face and GGUF: the model's logits and its tokenizer's ids survive
every hop, a tiktoken-trained model's Hugging Face folder loads in AutoTokenizer, and bad destinations are one
line."""

from __future__ import annotations

import pytest
import torch

from alignment.commands.cli import main
from data.tokenizer.hf import HFTokenizer
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.model import ModelConfig, Transformer

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TEXT = "KING HENRY: Once more unto the breach, dear friends!\n\n1234 ünïcode"


@pytest.fixture
def native(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=64)
    return save_checkpoint(Transformer(config), tmp_path / "native", tokenizer_path=Tokenizer.load("default").files)


def logits(folder, ids):
    with torch.no_grad():
        return load_checkpoint(folder).eval()(ids)


def test_native_to_gguf_and_back_keeps_logits_and_token_ids(native, tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    assert main(["convert", str(native), "--to", "gguf", str(gguf), "--dtype", "float32"]) == 0
    back = tmp_path / "back"
    assert main(["convert", str(gguf), "--to", "native", str(back)]) == 0  # --from auto: a .gguf file is GGUF
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(back, ids), logits(native, ids), atol=1e-5, rtol=0)
    converted = Tokenizer.load(back)  # the GGUF's tokenizer, as tokenizer.json: the ids of the tiktoken original
    assert isinstance(converted, HFTokenizer) and converted.encode(TEXT) == Tokenizer.load("default").encode(TEXT)
    chat = [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A friend."}]
    assert converted.encode_chat(chat) == Tokenizer.load("default").encode_chat(chat)
    # a second write is refused before any weights are read, naming the flag
    assert main(["convert", str(native), "--to", "gguf", str(gguf)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_native_to_hf_loads_in_transformers_with_its_tokenizer(native, tmp_path):
    hf = tmp_path / "hf"
    assert main(["convert", str(native), "--to", "hf", str(hf)]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(hf)
    assert theirs.encode(TEXT, add_special_tokens=False) == Tokenizer.load("default").encode(TEXT)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits(native, ids), atol=1e-4, rtol=0)
    back = tmp_path / "back"
    assert main(["convert", str(hf), "--to", "native", str(back)]) == 0
    assert Tokenizer.load(back).fingerprint == Tokenizer.load("default").fingerprint  # the tiktoken file wins


def test_gguf_to_gguf_and_a_folder_without_tokenizer_are_one_line(native, tmp_path, capsys):
    assert main(["convert", str(tmp_path / "x.gguf"), "--to", "gguf", str(tmp_path / "y.gguf")]) == 2
    assert "already a GGUF file" in capsys.readouterr().err
    (native / "tokenizer.model").unlink()
    assert main(["convert", str(native), "--to", "gguf", str(tmp_path / "y.gguf")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "no tokenizer" in err[0] and not (tmp_path / "y.gguf").exists()


@pytest.mark.parametrize("given", ["hf", "meta"])
def test_a_source_format_that_is_not_the_folders_names_what_it_is(native, tmp_path, given, capsys):
    """Before: `--from hf` of a native folder said config.json was missing; `--from meta` that params.json was found.
    A native folder is a Hugging Face one too (config.json beside lantern.json), so `--from hf` reads it as one; one
    written without config.json (a model transformers has no class for) is named as native."""
    if given == "hf":
        assert main(["convert", "--from", "hf", str(native), "--to", "native", str(tmp_path / "as-hf")]) == 0
        ids = torch.randint(0, 4096, (1, 8), generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(logits(tmp_path / "as-hf", ids), logits(native, ids), atol=1e-6, rtol=0)
        (native / "config.json").unlink()
    args = ["convert", "--from", given, str(native), "--to", "hf", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    names = {"hf": "Hugging Face", "meta": "Meta"}
    assert err == (
        f"lantern convert: error: {native} is a native (Lantern) checkpoint folder, not a {names[given]} one: read "
        "it as native (lantern convert --from native, or --from auto)"
    ), err
    assert not (tmp_path / "out").exists()
