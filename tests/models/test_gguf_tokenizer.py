"""Sentencepiece-spelled BPE tokenizers (Gemma's, Llama 2's: spaces as "\u2581", byte fallback) written into GGUF as
llama.cpp's ``llama`` tokenizer, its merge order as scores: transformers' GGUF reader and Lantern's own conversion
tokenize as the tokenizer.json did. llama.cpp itself is checked on Gemma 3 270M in benchmarks/gguf_llama_cpp.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from data.tokenizer.tokenizer import Tokenizer  # noqa: E402
from models.errors import LanternError, one_line  # noqa: E402
from models.formats.gguf_format import convert_gguf, write_gguf  # noqa: E402
from models.formats.gguf_tokenizer import gguf_tokenizer_fields, write_tokenizer_files  # noqa: E402
from tests.conftest import CORPUS  # noqa: E402
from tests.models.test_gguf_format import OTHER_FAMILIES, tiny_model  # noqa: E402

SPACE = "\u2581"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
PROBES = [
    "ROMEO: What, ho! Who is there?",
    "  two leading spaces,  and  doubled  ones  ",
    "lines\nand\n\nparagraphs\n",
    "héllo 日本語 😀 — bytes the vocabulary lacks",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
]


def sentencepiece_folder(folder: Path, corpus: str, *, space_prefix: bool) -> Path:
    """A small BPE over "\u2581"-spelled text with byte fallback, as Hugging Face writes Gemma's (no prefix) or
    Llama 2's (a "\u2581" prepended), trained on ``corpus``; the 256 <0xXX> tokens follow the specials."""
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False)
    trained = HFTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", SPACE)
    trained.train_from_iterator(corpus.splitlines(), trainer)
    state = json.loads(trained.model.__getstate__())
    learned = sorted(state["vocab"].items(), key=lambda item: item[1])
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    order = SPECIALS + byte_tokens + [token for token, _ in learned if token not in SPECIALS]
    vocab = {token: index for index, token in enumerate(order)}
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in state["merges"]]
    tokenizer = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if space_prefix else spaces
    if not space_prefix:
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")  # Gemma's (inert) split
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(SPECIALS)
    write_tokenizer_files(folder, tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                          unk_token="<unk>", add_bos_token=True)  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def corpus() -> str:
    return CORPUS.read_text(encoding="utf-8")[:60_000]


@pytest.fixture(scope="module")
def gemma_spelled(tmp_path_factory, corpus) -> Path:
    return sentencepiece_folder(tmp_path_factory.mktemp("gemma-spelled"), corpus, space_prefix=False)


@pytest.mark.parametrize(("family", "space_prefix"), [("gemma3", False), ("llama", True)])
def test_sentencepiece_tokenizers_read_back_with_the_same_ids(tmp_path: Path, corpus, family, space_prefix) -> None:
    folder = sentencepiece_folder(tmp_path / "tokenizer", corpus, space_prefix=space_prefix)
    fields = gguf_tokenizer_fields(folder, vocab_size=1024)
    assert (fields["model"], fields["pre"], fields["add_space_prefix"]) == ("llama", "default", space_prefix)
    assert fields["token_type"][4:260] == [6] * 256 and fields["tokens"][4] == "<0x00>"  # BYTE
    assert fields["token_type"][1023] == 5  # padding: UNUSED
    merged = fields["tokens"].index("".join(fields["merges"][0].split(" ")))  # the first merge scores highest
    assert fields["scores"][merged] == 0.0 and max(fields["scores"][260:]) == 0.0
    overrides = OTHER_FAMILIES["gemma3"][1] if family == "gemma3" else {}
    model = tiny_model(vocab_size=1024, **overrides)
    path = write_gguf(model, tmp_path / f"{family}.gguf", folder, dtype="f32")
    ours = Tokenizer.load(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    converted = Tokenizer.load(convert_gguf(path, tmp_path / "native", "native"))
    for text in PROBES:
        expected = ours.encode(text, bos=True)
        assert converted.encode(text, bos=True) == expected, text
        assert converted.decode(expected[1:]) == text
        # transformers' own reader (Metaspace) adds no prefix to text that starts with a space; llama.cpp does, as
        # the tokenizer.json and Lantern's conversion do (test_llama_cpp_tokenizes_as_the_tokenizer_json)
        if not (space_prefix and text.startswith(" ")):
            assert theirs(text)["input_ids"] == expected, text


@pytest.mark.parametrize(("family", "space_prefix"), [("gemma3", False), ("llama", True)])
def test_llama_cpp_tokenizes_as_the_tokenizer_json(tmp_path: Path, corpus, family, space_prefix) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's client: pip install llama-cpp-python==0.3.36")
    folder = sentencepiece_folder(tmp_path / "tokenizer", corpus, space_prefix=space_prefix)
    overrides = OTHER_FAMILIES["gemma3"][1] if family == "gemma3" else {}
    path = write_gguf(tiny_model(vocab_size=1024, **overrides), tmp_path / f"{family}.gguf", folder, dtype="f32")
    ours = Tokenizer.load(folder)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in PROBES:
        assert llm.tokenize(text.encode("utf-8"), add_bos=True, special=False) == ours.encode(text, bos=True), text


def test_tokenizers_gguf_cannot_spell_are_refused_in_one_line(tmp_path: Path, gemma_spelled) -> None:
    data = json.loads((gemma_spelled / "tokenizer.json").read_text())
    for name, change in {
        "nfkc": {"normalizer": {"type": "NFKC"}},
        "no-byte-fallback": {"model": {**data["model"], "byte_fallback": False}},
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({**data, **change}))
        with pytest.raises(LanternError) as error:
            gguf_tokenizer_fields(folder)
        assert one_line(error.value) == str(error.value) and str(folder / "tokenizer.json") in str(error.value)
