"""One parse of a GGUF file per call (models/formats/gguf_reader.py): inside a ``parsed_once`` function every reader of
a file is one object, transformers' included; outside it, and once it returns, each reader is new again."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads GGUF files through it

from models.formats.gguf_format import convert_gguf, write_gguf  # noqa: E402
from models.formats.gguf_reader import parsed_once  # noqa: E402
from tests.models.test_gguf_format import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from data.tokenizer.convert import write_hf_tokenizer
    from data.tokenizer.files import DEFAULT_TOKENIZER_PATH
    from data.tokenizer.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("gguf-reader")
    write_hf_tokenizer(Tokenizer.from_file(DEFAULT_TOKENIZER_PATH), folder / "tokenizer")
    return write_gguf(tiny_model(), folder / "model.gguf", folder / "tokenizer", dtype="f32")


def count_parses(monkeypatch) -> list[str]:
    """The files gguf's reader parses from now on (the real class, counted)."""
    parsed: list[str] = []
    real = gguf.GGUFReader

    class Counted(real):
        def __init__(self, path, mode="r"):
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    return parsed


def test_inside_one_call_every_reader_of_a_file_is_one_parse(gguf_file, monkeypatch):
    parsed = count_parses(monkeypatch)

    @parsed_once
    def read_twice_and_nested():
        first, second = gguf.GGUFReader(gguf_file), gguf.GGUFReader(str(gguf_file))
        nested = parsed_once(lambda: gguf.GGUFReader(gguf_file))()
        return first, second, nested

    first, second, nested = read_twice_and_nested()
    assert first is second is nested and len(parsed) == 1
    assert gguf.GGUFReader(gguf_file) is not first and len(parsed) == 2  # after the call: a new parse again
    assert gguf.GGUFReader.__name__ == "Counted"  # the real class is back in place


def test_a_conversion_parses_the_file_once_where_it_parsed_it_four_times(gguf_file, tmp_path, monkeypatch):
    """Lantern's metadata, transformers' config, weights and tokenizer: one parse (this test fails with four
    without ``parsed_once``), and the same folder as before."""
    parsed = count_parses(monkeypatch)
    convert_gguf(gguf_file, tmp_path / "native")
    assert [os.path.realpath(path) for path in parsed] == [os.path.realpath(gguf_file)]
    assert (tmp_path / "native" / "tokenizer.json").is_file()


def test_the_reader_is_restored_when_the_call_fails(gguf_file):
    real = gguf.GGUFReader

    @parsed_once
    def fails():
        gguf.GGUFReader(gguf_file)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fails()
    assert gguf.GGUFReader is real
