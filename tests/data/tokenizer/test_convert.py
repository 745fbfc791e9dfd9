"""Tiktoken tokenizers as Hugging Face files (data/tokenizer/convert.py): transformers' AutoTokenizer encodes the ids
Lantern's Tokenizer does, plain text and chats."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
transformers = pytest.importorskip("transformers")

from data.tokenizer.convert import (  # noqa: E402
    hf_tokenizer_folder,
    tiktoken_to_tokenizer_json,
    write_hf_tokenizer,
)
from data.tokenizer.files import DEFAULT_TOKENIZER_PATH, read_rank_file  # noqa: E402
from data.tokenizer.tokenizer import LLAMA3_PAT, Tokenizer  # noqa: E402
from models.errors import LanternError  # noqa: E402
from models.formats.gguf_tokenizer import LLAMA3_SPLIT  # noqa: E402

CORPUS = Path(__file__).resolve().parents[3] / "data" / "corpus" / "tinyshakespeare.txt"
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": " Be brief.\n"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4\n\n"},
    ],
    [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "  ok  "},
        {"role": "user", "content": "héllo\n\nworld 12345 — “quoted” 日本語 😀"},
    ],
]


def varied_texts() -> list[str]:
    """Shakespeare, then what a tokenizer port usually gets wrong: unicode, emoji, runs of newlines and spaces,
    digit groups, contractions, long words, code; and random strings over those alphabets."""
    corpus = CORPUS.read_text(encoding="utf-8")[:60_000]
    texts = [corpus[i : i + 3000] for i in range(0, len(corpus), 3000)]
    texts += [
        "héllo wörld ñ 日本語のテキスト 😀🎉 \u200b Ünïcödé façade — “quotes” …",
        "12345678901 3.14159 1,000,000 2024-06-01 0x1F",
        "  leading   spaces\n\n\n  and\ttabs\r\n trailing  ",
        "supercalifragilisticexpialidocious antidisestablishmentarianism " + "x" * 300,
        "I'm you're they'll we've he'd SHE'S O'er",
        "def f(x):\n    return x**2  # comment\n\n\nclass A:  pass\n",
        "a\n\nb\n \n c   ",
        "",
        "\n",
        " ",
    ]
    rng = random.Random(0)
    pools = [(32, 126), (0x80, 0x2FF), (0x4E00, 0x4E50), (0x1F600, 0x1F64F), (10, 10), (32, 32), (48, 57)]
    for _ in range(200):
        texts.append("".join(chr(rng.randint(*rng.choice(pools))) for _ in range(rng.randint(1, 80))))
    return texts


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> tuple[Tokenizer, object, Path]:
    """Lantern's shipped tokenizer, its Hugging Face folder and transformers' tokenizer loaded from it."""
    tok = Tokenizer.from_file(DEFAULT_TOKENIZER_PATH)
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    write_hf_tokenizer(tok, folder)
    return tok, transformers.AutoTokenizer.from_pretrained(folder), folder


def test_ids_match_tiktoken_on_varied_text(shakespeare) -> None:
    tok, hf, _ = shakespeare
    for text in varied_texts():
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text), repr(text[:80])
        assert hf(text)["input_ids"] == tok.encode(text, bos=True), repr(text[:80])  # the post-processor adds BOS
    sample = "ROMEO:\nWhat, ho! 12345 héllo"
    assert hf.decode(hf(sample)["input_ids"], skip_special_tokens=True) == sample


def test_chat_template_gives_encode_chat_ids(shakespeare) -> None:
    tok, hf, _ = shakespeare
    for messages in CONVERSATIONS:
        chat = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        prompt = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert chat == tok.encode_chat(messages)[0]
        assert prompt["input_ids"] == tok.encode_chat_prompt(messages)


def test_special_tokens_and_files(shakespeare) -> None:
    tok, hf, folder = shakespeare
    assert {p.name for p in folder.iterdir()} == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert all(hf.convert_tokens_to_ids(name) == i for name, i in tok.special_tokens.items())
    assert len(hf) == tok.vocab_size
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": tok.bos_id, "eos_token_id": [tok.eos_id, tok.eom_id, tok.eot_id]}
    assert LLAMA3_SPLIT == LLAMA3_PAT  # models/ keeps its own copy of the regex (it cannot import data/)


def test_cl100k_possessive_digits_are_read_as_tiktoken_does(tmp_path: Path) -> None:
    """cl100k's \\p{N}{1,3}+ is a nested repetition for Oniguruma: without the fix, "14159" would be one piece."""
    tok = Tokenizer.cl100k_base()
    write_hf_tokenizer("cl100k_base", tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["pi is 3.14159, e is 2.718281828", "1,000,000 and 12345678901", *varied_texts()[-40:]]:
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text), repr(text)


def test_special_ids_must_follow_the_ranks() -> None:
    ranks, _ = read_rank_file(DEFAULT_TOKENIZER_PATH)
    with pytest.raises(LanternError, match="must follow the 3840 ranks"):
        tiktoken_to_tokenizer_json(ranks, {"<|begin_of_text|>": 5000}, LLAMA3_PAT)


def test_hf_tokenizer_folder(tmp_path: Path) -> None:
    """A checkpoint with a rank file is converted; one with tokenizer.json is read where it is (copied when the file
    bears the rank file's name); one with neither is refused."""
    tiktoken_checkpoint = tmp_path / "native"
    tiktoken_checkpoint.mkdir()
    (tiktoken_checkpoint / "tokenizer.model").write_bytes(DEFAULT_TOKENIZER_PATH.read_bytes())
    converted = hf_tokenizer_folder(tiktoken_checkpoint, tmp_path / "scratch1")
    assert (converted / "tokenizer.json").is_file() and (converted / "tokenizer_config.json").is_file()
    assert hf_tokenizer_folder(converted, tmp_path / "scratch2") == converted  # read where it is
    (tmp_path / "renamed").mkdir()  # a tokenizer.json saved under the rank file's name: copied under its own
    (tmp_path / "renamed" / "tokenizer.model").write_bytes((converted / "tokenizer.json").read_bytes())
    (tmp_path / "renamed" / "tokenizer_config.json").write_bytes((converted / "tokenizer_config.json").read_bytes())
    copied = hf_tokenizer_folder(tmp_path / "renamed", tmp_path / "scratch4")
    assert (copied / "tokenizer.json").read_bytes() == (converted / "tokenizer.json").read_bytes()
    (tmp_path / "empty").mkdir()
    with pytest.raises(LanternError, match="no tokenizer in"):
        hf_tokenizer_folder(tmp_path / "empty", tmp_path / "scratch3")
