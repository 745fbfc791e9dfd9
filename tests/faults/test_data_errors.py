"""Bad data files are named before any compute: mis-encoded text / JSONL (file, line and byte offset) for
prepare, SFT, preference and prompt data and the tokenizer trainer; malformed and empty files; and the
``tokenizer train`` / ``demo-data`` commands refuse bad output paths and counts in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignment.commands.cli import main
from data.demo.tasks import load_jsonl, write_demo_dataset
from data.preference.config import PreferenceDataConfig
from data.preference.pairs import build_preference_data
from data.pretrain.config import PrepareConfig
from data.pretrain.prepare import prepare
from data.records.prompts import PromptDataConfig, load_prompts
from data.sft.datamodule import build_sft_data
from data.sft.rows import SFTDataConfig
from data.tokenizer.base import check_utf8
from data.tokenizer.bpe import train_bpe
from models.errors import DataError

SFT_ROW = {"prompt": "Who speaks first?", "response": "ROMEO"}
PAIR_ROW = {"prompt": "Who speaks first?", "chosen": "ROMEO", "rejected": "JULIET"}
LATIN1 = "Caf\u00e9 au lait".encode("latin-1")  # b"Caf\xe9 au lait": not UTF-8


def mis_encoded_jsonl(path: Path, row: dict, bad_field: str) -> tuple[Path, int]:
    """Two rows, the second with a Latin-1 byte in ``bad_field``; returns the path and the bad byte's offset."""
    first = (json.dumps(row) + "\n").encode()
    broken = json.dumps({**row, bad_field: "@@"}).encode().replace(b"@@", LATIN1) + b"\n"
    path.write_bytes(first + broken)
    return path, len(first) + broken.index(b"\xe9")


def test_check_utf8_names_line_and_byte_offset(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"first line\nsecond \xff line\n")
    with pytest.raises(DataError, match=rf"{path}: line 2, byte offset 18: not valid UTF-8"):
        check_utf8(path)


def test_check_utf8_finds_a_character_cut_at_the_end(tmp_path):
    path = tmp_path / "cut.txt"
    path.write_bytes("ok\nna\u00efve".encode()[:-3])  # the last character's second byte is gone
    with pytest.raises(DataError, match=r"line 2, byte offset 5"):
        check_utf8(path)


def test_check_utf8_accepts_multibyte_text_across_blocks(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text(
        "\u00e9\u4e2d\U0001f600 " * 2_000_000, encoding="utf-8"
    )  # 20 MB: a 16 MiB block ends inside an emoji
    check_utf8(path)


def test_prepare_names_a_mis_encoded_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello\n" + LATIN1 + b"\n")
    with pytest.raises(DataError, match=rf"{path}: line 2, byte offset 9"):
        prepare(PrepareConfig(source=[str(path)], out_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_prepare_names_a_mis_encoded_jsonl_file(tmp_path):
    """pyarrow's JSON reader passes invalid UTF-8 through: without the check it was tokenized as garbage."""
    path, offset = mis_encoded_jsonl(tmp_path / "docs.jsonl", {"text": "hello"}, "text")
    with pytest.raises(DataError, match=rf"docs.jsonl: line 2, byte offset {offset}"):
        prepare(PrepareConfig(source=[str(path)], out_dir=str(tmp_path / "out")))


def test_prepare_names_an_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ValueError, match=rf"empty corpus: no non-empty documents in {path}"):
        prepare(PrepareConfig(source=[str(path)], out_dir=str(tmp_path / "out")))


def test_sft_names_a_mis_encoded_jsonl_file(tmp_path):
    path, offset = mis_encoded_jsonl(tmp_path / "sft.jsonl", SFT_ROW, "response")
    with pytest.raises(DataError, match=rf"sft.jsonl: line 2, byte offset {offset}"):
        build_sft_data(SFTDataConfig(train=[str(path)], seq_len=64))


def test_sft_names_a_malformed_json_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(SFT_ROW) + "\n" + '{"prompt": "hi", "response"\n')
    with pytest.raises(ValueError, match=rf"{path}, line 2: invalid JSON"):
        build_sft_data(SFTDataConfig(train=[str(path)], seq_len=64))


def test_sft_row_larger_than_a_reader_block_is_truncated_not_fatal(tmp_path):
    """A 12 MB answer on one JSONL line (more than pyarrow's JSON block): read, cut to seq_len and counted."""
    rows = [SFT_ROW] * 3 + [{"prompt": "Say it all.", "response": "word " * 2_400_000}]
    path = tmp_path / "huge.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = build_sft_data(SFTDataConfig(train=[str(path)], seq_len=64, val_fraction=0.0)).stats
    assert stats["train"]["rows_read"] == 4 and stats["train"]["truncated"] == 1


def test_preference_names_a_mis_encoded_jsonl_file(tmp_path):
    path, offset = mis_encoded_jsonl(tmp_path / "pairs.jsonl", PAIR_ROW, "rejected")
    with pytest.raises(DataError, match=rf"pairs.jsonl: line 2, byte offset {offset}"):
        build_preference_data(PreferenceDataConfig(train=[str(path)], seq_len=64))


def test_prompts_name_a_mis_encoded_jsonl_file(tmp_path, tok):
    path, offset = mis_encoded_jsonl(tmp_path / "prompts.jsonl", {"prompt": "Who speaks first?"}, "prompt")
    with pytest.raises(DataError, match=rf"prompts.jsonl: line 2, byte offset {offset}"):
        load_prompts(PromptDataConfig(train=[str(path)]), [str(path)], tok)


def test_demo_jsonl_reader_names_the_bad_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2,}\n')
    with pytest.raises(DataError, match=rf"{path}, line 3: invalid JSON"):
        load_jsonl(path)


def test_tokenizer_training_names_a_mis_encoded_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"To be, or not to be\n" * 10 + LATIN1)
    with pytest.raises(DataError, match=rf"{path}: line 11, byte offset 203"):
        train_bpe(path, vocab_size=600, out=tmp_path / "tok.tiktoken")


# ---- the two commands that wrote files where they should not


def test_tokenizer_train_refuses_a_folder_as_out_before_training(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 50)
    (tmp_path / "tok").mkdir()
    code = main(["tokenizer", "train", "--corpus", str(corpus), "--vocab-size", "600", "--out", str(tmp_path / "tok")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"--out {tmp_path / 'tok'} is a folder" in err and "Traceback" not in err
    assert list((tmp_path / "tok").iterdir()) == []


def test_tokenizer_train_refuses_an_out_under_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="is a file, not a folder"):
        train_bpe(tmp_path / "corpus.txt", vocab_size=600, out=tmp_path / "file" / "tok.tiktoken")


@pytest.mark.parametrize(("flag", "value"), [("--n-train", "-5"), ("--n-val", "0"), ("--n-pairs", "-1")])
def test_demo_data_refuses_counts_below_one(tmp_path, capsys, flag, value):
    code = main(["demo-data", "--out", str(tmp_path / "demo"), flag, value])
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.count("\n") == 1
        and f"{flag[2:].replace('-', '_')} must be an integer >= 1, got {value}" in err
    )
    assert not (tmp_path / "demo").exists()


def test_demo_data_refuses_a_file_as_out(tmp_path, capsys):
    (tmp_path / "demo.jsonl").write_text("")
    code = main(["demo-data", "--out", str(tmp_path / "demo.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is a file" in err and "Traceback" not in err
    with pytest.raises(DataError):
        write_demo_dataset(tmp_path / "demo.jsonl", n_train=1, n_val=1, n_pairs=1)


def test_demo_data_line_count_miscount_through_the_cli_and_a_bad_share_touches_nothing(tmp_path, capsys):
    """--line-count-miscount reaches the files; an out-of-range share is one line, and an existing folder keeps its
    files and manifest (the check runs before anything is removed)."""
    out = tmp_path / "demo"
    common = ["demo-data", "--out", str(out), "--n-train", "60", "--n-val", "10", "--n-pairs", "10"]
    assert main([*common, "--short-share", "1", "--line-count-miscount", "1"]) == 0
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    line_count = [r for r in train if r["task"] == "line_count"]
    assert line_count and all(r.get("miscounted") for r in line_count)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    for share in ("1.5", "-0.1"):
        assert main([*common, "--line-count-miscount", share]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "line_count_miscount must be in [0, 1]" in err and "Traceback" not in err
        assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_a_parquet_file_that_is_not_one_is_named(tmp_path, kind):
    """Before: pyarrow's "Parquet magic bytes not found in footer", naming no file."""
    from data.records.chat import resolve_sources

    path = tmp_path / "rows.parquet"
    path.write_text('{"text": "not parquet"}\n')
    with pytest.raises(ValueError, match=rf"{path} is not a Parquet file") as error:
        if kind == "pretrain":
            prepare(PrepareConfig(source=[str(path)], out_dir=str(tmp_path / "out")))
        else:
            resolve_sources(SFTDataConfig(train=[str(path)]), [str(path)])
    assert "\n" not in str(error.value)
