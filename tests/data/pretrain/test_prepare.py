"""Tests for data/pretrain/prepare.py: local text / JSONL / Parquet corpora in temp dirs, no network."""

import base64
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from data.pretrain.config import PrepareConfig
from data.pretrain.manifest import check_manifest
from data.pretrain.prepare import prepare
from data.streams.datamodule import PackedDataset
from data.streams.shards import TokenStream
from data.tokenizer.tokenizer import Tokenizer
from models.config_checks import check_config
from models.files.folders import FOLDER_MARKER, LOCK_FILE, READERS_FILE

NUM_DOCS = 40


def make_docs(n: int = NUM_DOCS) -> list[str]:
    # Unique, multi-line paragraphs so each document can be identified from its tokens.
    return [f"Document {i}: to be, or not to be.\nThat is question number {i * 7}." for i in range(n)]


@pytest.fixture
def text_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    docs = make_docs()
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path, docs


def config(tmp_path: Path, source, **kwargs) -> PrepareConfig:
    kwargs.setdefault("num_proc", 1)
    kwargs.setdefault("val_fraction", 0.1)
    return PrepareConfig(source=[str(s) for s in source], out_dir=str(tmp_path / "out"), **kwargs)


def split_documents(out_dir: Path, split: str) -> list[list[int]]:
    stream = TokenStream(out_dir / split)
    tokens = stream.read(0, len(stream)).tolist()
    offsets = np.load(out_dir / split / "doc_offsets.npy")
    assert offsets[0] == 0 and offsets[-1] == len(tokens) and np.all(np.diff(offsets) > 0)
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def assert_partition(out_dir: Path, expected: list[list[int]]) -> tuple[list[int], list[int]]:
    """train + val documents are exactly the expected ones, disjoint, each split in input order."""
    position = {tuple(ids): i for i, ids in enumerate(expected)}
    assert len(position) == len(expected), "test documents must be unique"
    train = [position[tuple(d)] for d in split_documents(out_dir, "train")]
    val = [position[tuple(d)] for d in split_documents(out_dir, "val")]
    assert train == sorted(train) and val == sorted(val)
    assert not set(train) & set(val)
    assert sorted(train + val) == list(range(len(expected)))
    return train, val


def shard_mtimes(out_dir: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(out_dir.glob("*/shard-*.bin"))}


# -----------------------------------------------------------------------------
# formats and contents


def test_text_corpus_manifest_and_tokens(tmp_path, text_corpus, tok):
    path, docs = text_corpus
    cfg = config(tmp_path, [path], num_proc=2)  # exercise the worker processes once
    manifest = prepare(cfg)
    out = Path(cfg.out_dir)

    assert manifest == json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 1
    assert manifest["tokenizer"] == {"spec": "default", "fingerprint": tok.fingerprint, "vocab_size": 4096}
    [entry] = manifest["inputs"]
    assert entry["path"] == str(path) and entry["size"] == path.stat().st_size
    assert entry["mtime_ns"] == path.stat().st_mtime_ns and len(entry["sha256"]) == 64
    assert manifest["settings"]["sample_by"] == "paragraph" and manifest["settings"]["val_fraction"] == 0.1
    assert manifest["dtype"] == "uint16"

    expected = [tok.encode(d, bos=True, eos=True) for d in docs]
    train, val = assert_partition(out, expected)
    assert len(val) == 4  # round(40 * 0.1)
    for split, idx in (("train", train), ("val", val)):
        info = manifest["splits"][split]
        assert info["documents"] == len(idx)
        assert info["tokens"] == sum(len(expected[i]) for i in idx)
        [shard] = info["shards"]
        assert (out / split / shard["file"]).stat().st_size == 2 * info["tokens"]
    # Raw little-endian uint16 on disk.
    raw = np.fromfile(out / "train" / "shard-00000.bin", dtype="<u2")
    assert raw[: len(expected[train[0]])].tolist() == expected[train[0]]
    # No build leftovers.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [FOLDER_MARKER, LOCK_FILE, READERS_FILE, "manifest.json", "train", "val"]
    )


@pytest.mark.parametrize("num_proc", [1, 3])
def test_batches_and_workers_change_nothing_on_disk(tmp_path, text_corpus, tok, monkeypatch, num_proc):
    """Many small batches, on one worker or three processes, with whitespace-only documents among them: the same
    shards, offsets and validation choice as one batch."""
    import data.pretrain.prepare as prep

    path, docs = text_corpus
    path.write_text("\n\n".join(d if i % 5 else f"{d}\n\n \n\n\t" for i, d in enumerate(docs)) + "\n")
    one = config(tmp_path, [path], num_proc=1, val_fraction=0.2)
    one.out_dir = str(tmp_path / "one")
    expected = prepare(one)
    monkeypatch.setattr(prep, "_BATCH_BYTES", 100)  # a document or two each
    many = config(tmp_path, [path], num_proc=num_proc, val_fraction=0.2)
    manifest = prepare(many)
    assert manifest["splits"] == expected["splits"]
    for split in ("train", "val"):
        assert split_documents(Path(many.out_dir), split) == split_documents(Path(one.out_dir), split)
    assert_partition(Path(many.out_dir), [tok.encode(d, bos=True, eos=True) for d in docs])


def test_val_split_is_deterministic_and_seeded(tmp_path, text_corpus, tok):
    path, docs = text_corpus
    expected = [tok.encode(d, bos=True, eos=True) for d in docs]
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        cfg = PrepareConfig(source=[str(path)], out_dir=str(tmp_path / name), seed=seed, num_proc=1, val_fraction=0.25)
        prepare(cfg)
        runs[name] = assert_partition(Path(cfg.out_dir), expected)[1]
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]


def test_sample_by_line_and_document_no_bos(tmp_path, text_corpus, tok):
    path, docs = text_corpus
    lines = [line for d in docs for line in d.split("\n")]
    cfg = config(tmp_path, [path], sample_by="line", add_bos=False, val_fraction=0.0)
    manifest = prepare(cfg)
    assert manifest["splits"]["train"]["documents"] == len(lines)  # blank lines are not documents
    assert manifest["splits"]["val"] == {"tokens": 0, "documents": 0, "shards": []}
    assert split_documents(Path(cfg.out_dir), "train") == [tok.encode(x, eos=True) for x in lines]

    cfg = PrepareConfig(
        source=[str(path), str(path.with_name("b.txt"))],
        out_dir=str(tmp_path / "doc"),
        sample_by="document",
        val_fraction=0.5,
        num_proc=1,
    )
    path.with_name("b.txt").write_text("second file", encoding="utf-8")
    manifest = prepare(cfg)
    assert manifest["splits"]["train"]["documents"] == 1 and manifest["splits"]["val"]["documents"] == 1
    whole = [tok.encode(path.read_text(), bos=True, eos=True), tok.encode("second file", bos=True, eos=True)]
    assert_partition(Path(cfg.out_dir), whole)


def test_jsonl_custom_text_field(tmp_path, tok):
    docs = make_docs(12)
    path = tmp_path / "data.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "content": d, "meta": {"lang": "en"}}) + "\n")
        f.write(json.dumps({"id": 99, "content": "   "}) + "\n")  # whitespace-only: skipped
    cfg = config(tmp_path, [path], text_field="content", val_fraction=0.2)
    manifest = prepare(cfg)
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 12
    assert_partition(Path(cfg.out_dir), [tok.encode(d, bos=True, eos=True) for d in docs])


def test_parquet_glob(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(20)
    (tmp_path / "pq").mkdir()
    for part in range(2):
        table = pa.table({"body": docs[part * 10 : (part + 1) * 10], "n": list(range(10))})
        pq.write_table(table, tmp_path / "pq" / f"part-{part}.parquet")
    cfg = config(tmp_path, [tmp_path / "pq" / "*.parquet"], text_field="body")
    manifest = prepare(cfg)
    assert [Path(e["path"]).name for e in manifest["inputs"]] == ["part-0.parquet", "part-1.parquet"]
    assert_partition(Path(cfg.out_dir), [tok.encode(d, bos=True, eos=True) for d in docs])


def test_cl100k_uses_uint32(tmp_path):
    tok = Tokenizer.load("cl100k_base")
    assert tok.vocab_size > 65536
    docs = ["Hello world, this is cl100k.", "Another small document.", "Third one here."]
    path = tmp_path / "small.txt"
    path.write_text("\n\n".join(docs), encoding="utf-8")
    cfg = config(tmp_path, [path], tokenizer="cl100k_base", val_fraction=0.0)
    manifest = prepare(cfg)
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"]["vocab_size"] == tok.vocab_size
    expected = [t for d in docs for t in tok.encode(d, bos=True, eos=True)]
    raw = np.fromfile(Path(cfg.out_dir) / "train" / "shard-00000.bin", dtype="<u4")
    assert raw.tolist() == expected and max(expected) >= 65536  # BOS id 100256 needs 32 bits


def test_multi_shard_reads_across_boundaries(tmp_path, text_corpus, tok):
    path, docs = text_corpus
    cfg = config(tmp_path, [path], shard_tokens=50, val_fraction=0.0)
    manifest = prepare(cfg)
    out = Path(cfg.out_dir)
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > 5 and all(s["tokens"] == 50 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 50
    concatenated = np.concatenate([np.fromfile(out / "train" / s["file"], dtype="<u2") for s in shards])
    expected = [t for d in docs for t in tok.encode(d, bos=True, eos=True)]
    assert concatenated.tolist() == expected
    stream = TokenStream(out / "train")
    assert len(stream) == len(expected)
    rng = np.random.default_rng(0)
    for start, stop in [(0, len(expected)), (45, 55), (49, 50), (50, 151), (0, 0), (len(expected) - 3, len(expected))]:
        assert stream.read(start, stop).tolist() == expected[start:stop]
    for _ in range(50):
        a, b = sorted(rng.integers(0, len(expected) + 1, size=2))
        assert stream.read(int(a), int(b)).tolist() == expected[a:b]
    with pytest.raises(IndexError):
        stream.read(0, len(expected) + 1)


def test_hub_dataset_path(tmp_path, monkeypatch, tok):
    # No network: stand in for the hub with an in-memory dataset, checking how it is called.
    import datasets

    docs = make_docs(10)
    fake = datasets.Dataset.from_dict({"text": docs, "url": ["u"] * 10})
    calls = []

    def fake_load_dataset(name, subset=None, split=None, **kwargs):
        calls.append((name, subset, split))
        return fake

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = PrepareConfig(
        source=["someone/tiny-corpus:en"], format="hub", out_dir=str(tmp_path / "hub"), num_proc=1, val_fraction=0.2
    )
    manifest = prepare(cfg)
    assert calls == [("someone/tiny-corpus", "en", "train")]
    assert manifest["inputs"] == [{"path": "someone/tiny-corpus:en", "fingerprint": fake._fingerprint}]
    assert_partition(Path(cfg.out_dir), [tok.encode(d, bos=True, eos=True) for d in docs])
    before = shard_mtimes(Path(cfg.out_dir))
    prepare(cfg)  # same dataset fingerprint: nothing rebuilt
    assert shard_mtimes(Path(cfg.out_dir)) == before


# -----------------------------------------------------------------------------
# idempotence and change detection


def test_rerun_is_noop_and_changes_rebuild(tmp_path, text_corpus, caplog):
    path, _docs = text_corpus
    cfg = config(tmp_path, [path])
    out = Path(cfg.out_dir)
    first = prepare(cfg)
    mtimes = shard_mtimes(out)
    manifest_mtime = (out / "manifest.json").stat().st_mtime_ns

    with caplog.at_level(logging.INFO, logger="lantern.prepare"):
        again = prepare(cfg)
    assert "up to date" in caplog.text
    assert again == first and shard_mtimes(out) == mtimes
    assert (out / "manifest.json").stat().st_mtime_ns == manifest_mtime

    # num_proc does not change the bytes: still up to date.
    cfg.num_proc = 2
    prepare(cfg)
    assert shard_mtimes(out) == mtimes

    # Touching the file without changing it is not a change (content hash decides).
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lantern.prepare"):
        prepare(cfg)
    assert "up to date" in caplog.text and shard_mtimes(out) == mtimes

    # A setting that changes the data.
    caplog.clear()
    cfg.val_fraction = 0.2
    with caplog.at_level(logging.INFO, logger="lantern.prepare"):
        changed = prepare(cfg)
    assert "settings changed: val_fraction: 0.1 → 0.2" in caplog.text
    assert changed["splits"]["val"]["documents"] == 8

    # An edited input.
    caplog.clear()
    with open(path, "a", encoding="utf-8") as f:
        f.write("\nA brand new paragraph.\n")
    with caplog.at_level(logging.INFO, logger="lantern.prepare"):
        grown = prepare(cfg)
    assert "input changed" in caplog.text and str(path) in caplog.text
    assert sum(s["documents"] for s in grown["splits"].values()) == NUM_DOCS + 1


def write_byte_tokenizer(path: Path) -> Path:
    """A minimal valid rank file (the 256 single bytes): a different tokenizer from the default."""
    path.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256)))
    return path


def test_changed_tokenizer_rebuilds_and_check_manifest(tmp_path, text_corpus, tok, caplog):
    path, _ = text_corpus
    cfg = config(tmp_path, [path])
    out = Path(cfg.out_dir)
    prepare(cfg)
    check_manifest(out, tok)  # same tokenizer: fine
    check_manifest(out, "default")

    byte_tok = Tokenizer.load(write_byte_tokenizer(tmp_path / "bytes.tiktoken"))
    with pytest.raises(ValueError) as err:
        check_manifest(out, byte_tok)
    message = str(err.value)
    assert tok.fingerprint in message and byte_tok.fingerprint in message and "lantern prepare" in message

    cfg.tokenizer = byte_tok.path
    with caplog.at_level(logging.INFO, logger="lantern.prepare"):
        manifest = prepare(cfg)
    assert "tokenizer changed: default" in caplog.text and "→" in caplog.text
    assert manifest["tokenizer"]["fingerprint"] == byte_tok.fingerprint
    check_manifest(out, byte_tok)
    with pytest.raises(ValueError, match="lantern prepare"):
        check_manifest(out, tok)


def test_check_manifest_without_data(tmp_path, tok):
    with pytest.raises(ValueError, match="no manifest.json.*lantern prepare"):
        check_manifest(tmp_path, tok)


def test_interrupted_prepare_leaves_no_manifest(tmp_path, text_corpus, monkeypatch):
    import data.pretrain.prepare as prep

    path, _ = text_corpus
    cfg = config(tmp_path, [path])

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_write_splits", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    out = Path(cfg.out_dir)
    assert not (out / "manifest.json").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [FOLDER_MARKER, LOCK_FILE, READERS_FILE]
    )  # build dir cleaned up
    with pytest.raises(ValueError, match="no manifest.json"):
        TokenStream(out / "train")

    monkeypatch.undo()
    prepare(cfg)
    assert (out / "manifest.json").exists()


# -----------------------------------------------------------------------------
# input errors: raised before tokenizing, naming what is wrong


@pytest.fixture
def no_tokenizing(monkeypatch):
    import data.pretrain.prepare as prep

    def fail(*args, **kwargs):
        raise AssertionError("tokenized despite bad input")

    monkeypatch.setattr(prep, "_tokenize_batch", fail)


def test_missing_file_and_empty_glob(tmp_path, no_tokenizing):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare(config(tmp_path, [missing]))
    with pytest.raises(FileNotFoundError, match=r"no files match .*\*\.jsonl"):
        prepare(config(tmp_path, [tmp_path / "*.jsonl"]))
    with pytest.raises(FileNotFoundError, match="format: hub"):
        prepare(config(tmp_path, ["someone/dataset"]))


def test_empty_corpus(tmp_path, no_tokenizing):
    path = tmp_path / "blank.txt"
    path.write_text("\n\n   \n\n\t\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty corpus.*blank\.txt"):
        prepare(config(tmp_path, [path], sample_by="line"))
    for name in ("zero.txt", "zero.jsonl"):
        (tmp_path / name).write_bytes(b"")
        with pytest.raises(ValueError, match=rf"empty corpus.*{name}"):
            prepare(config(tmp_path, [tmp_path / name]))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_json_missing_field_names_file_and_row(tmp_path, no_tokenizing):
    path = tmp_path / "rows.jsonl"
    rows = [{"text": "fine"}, {"text": "also fine"}, {"body": "no text here"}, {"text": "ok"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(ValueError) as err:
        prepare(config(tmp_path, [path]))
    assert "rows.jsonl" in str(err.value) and "line 3" in str(err.value) and "'text'" in str(err.value)

    # The field exists nowhere: name the field and what is available.
    with pytest.raises(ValueError, match=r"'content'.*rows\.jsonl.*line 1"):
        prepare(config(tmp_path, [path], text_field="content"))

    # Not a string, and not JSON at all.
    path.write_text('{"text": "fine"}\n{"text": 5}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows\.jsonl, line 2: 'text' is int, not a string"):
        prepare(config(tmp_path, [path]))
    path.write_text('{"text": "fine"}\n\n{"text": "broken"\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows\.jsonl, line 3: invalid JSON"):
        prepare(config(tmp_path, [path]))


def test_unknown_format_and_bad_settings(tmp_path, text_corpus, no_tokenizing):
    path, _ = text_corpus
    # Settings outside their declared choices and ranges are refused where the config is loaded (check_config).
    with pytest.raises(ValueError, match=r"prepare: format must be one of .*, got 'csv'"):
        check_config(config(tmp_path, [path], format="csv"), "prepare")
    odd = tmp_path / "data.xyz"
    odd.write_text("x")
    with pytest.raises(ValueError, match="cannot tell the format"):
        prepare(config(tmp_path, [odd]))
    with pytest.raises(ValueError, match="sample_by"):
        check_config(config(tmp_path, [path], sample_by="sentence"), "prepare")
    with pytest.raises(ValueError, match="val_fraction"):
        check_config(config(tmp_path, [path], val_fraction=1.0), "prepare")
    # One document cannot be split into train and val.
    with pytest.raises(ValueError, match="cannot hold out"):
        prepare(config(tmp_path, [path], sample_by="document", val_fraction=0.1))


def test_corpus_shorter_than_one_sequence(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("one\n\ntwo\n\nthree\n\nfour", encoding="utf-8")
    cfg = config(tmp_path, [path], val_fraction=0.25)
    manifest = prepare(cfg)
    n_val = manifest["splits"]["val"]["tokens"]
    with pytest.raises(ValueError) as err:
        PackedDataset(Path(cfg.out_dir) / "val", seq_len=64)
    assert str(err.value) == (
        f"split 'val' in {cfg.out_dir} has {n_val} tokens, fewer than one sequence of seq_len+1=65; "
        "lower loader.seq_len or add data"
    )
