"""Tests for a weighted mixture's config (data.sources) and its preparation (data/pretrain/mixture.py): bad input as
one line naming the key or source, each source prepared once into its folder and reused, the tokenizer check."""

import json
from pathlib import Path

import pytest

from alignment.schemas.pretrain import PretrainConfig
from data.pretrain.config import PrepareConfig, SourceConfig
from data.pretrain.mixture import MIXTURE_RECORD, check_prepared, prepare_data
from data.pretrain.prepare import prepare
from models.errors import ConfigError, DataError
from models.files.folders import FolderNotLanterns
from tests.data.pretrain.test_prepare import shard_mtimes, write_byte_tokenizer
from trainer.config import load_config


def two_sources(*more: str) -> list[str]:
    return [
        "data.sources=[{name: web, source: [web.txt], weight: 0.7}, {name: code, source: [code.jsonl], weight: 0.3}"
        + "".join(f", {m}" for m in more)
        + "]"
    ]


def test_a_mixture_config_loads_and_keeps_the_shared_settings():
    config = load_config(PretrainConfig, None, two_sources() + ["data.source=[]", "data.val_fraction=0.2"])
    assert [(s.name, s.weight) for s in config.data.sources] == [("web", 0.7), ("code", 0.3)]
    assert config.data.mixture and config.data.val_fraction == 0.2
    assert not load_config(PretrainConfig, None, []).data.mixture  # no sources: one corpus, as before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (two_sources("{name: math, source: [m.txt], weight: -1}"), r"data\.sources\[2\]\.weight must be > 0 but got -1"),
        (two_sources("{name: math, source: [m.txt], weight: 0}"), r"data\.sources\[2\]\.weight must be > 0 but got 0"),
        (two_sources("{name: math, source: [m.txt], weight: .nan}"), r"data\.sources\[2\]\.weight must be > 0 but got nan"),
        (["data.sources=[{name: a, source: [a.txt], weight: 0}, {name: b, source: [b.txt], weight: 0.0}]"],
         r"data\.sources\[0\]\.weight must be > 0"),  # all zero: the first is named
        (two_sources("{name: Web, source: [w2.txt]}"), r"data\.sources\[2\]\.name 'Web' repeats data\.sources\[0\]"),
        (two_sources("{name: ../up, source: [u.txt]}"), r"data\.sources\[2\]\.name must be 1-64 letters"),
        (two_sources("{source: [u.txt]}"), r"data\.sources\[2\]\.name must be"),
        (two_sources("{name: empty, source: []}"), r"data\.sources\[2\]\.source is empty"),
        (two_sources() + ["data.source=[other.txt]"], r"data\.source and data\.sources are both set"),
    ],
    ids=["negative", "zero", "nan", "all-zero", "duplicate", "unsafe-name", "no-name", "no-files", "with-source"],
)  # fmt: skip
def test_bad_mixture_configs_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(PretrainConfig, None, overrides)
    assert "\n" not in str(error.value)


@pytest.fixture
def corpora(tmp_path: Path) -> dict[str, Path]:
    web = tmp_path / "web.txt"
    web.write_text("\n\n".join(f"Web page {i}: the quick brown fox jumps." for i in range(30)) + "\n")
    code = tmp_path / "code.jsonl"
    code.write_text("\n".join(json.dumps({"content": f"def f{i}(x):\n    return x + {i}"}) for i in range(20)) + "\n")
    return {"web": web, "code": code}


def mixture(tmp_path: Path, corpora: dict[str, Path], **settings) -> PrepareConfig:
    return PrepareConfig(
        source=[],
        out_dir=str(tmp_path / "mix"),
        num_proc=1,
        val_fraction=0.1,
        sources=[
            SourceConfig("web", [str(corpora["web"])], 0.7),
            SourceConfig("code", [str(corpora["code"])], 0.3, text_field="content"),
        ],
        **settings,
    )


def test_prepare_writes_each_source_once_and_reuses_it(tmp_path, corpora, tok):
    config = mixture(tmp_path, corpora)
    record = prepare_data(config)
    out = Path(config.out_dir)
    assert sorted(record["sources"]) == ["code", "web"]
    for name, docs in (("web", 30), ("code", 20)):
        manifest = json.loads((out / name / "manifest.json").read_text())
        assert sum(split["documents"] for split in manifest["splits"].values()) == docs
        assert manifest["settings"]["out_dir"] == str(out / name)
    assert json.loads((out / "code" / "manifest.json").read_text())["settings"]["text_field"] == "content"
    assert json.loads((out / MIXTURE_RECORD).read_text()) == record
    assert record["splits"]["train"]["tokens"] == sum(
        s["splits"]["train"]["tokens"] for s in record["sources"].values()
    )

    before = {name: shard_mtimes(out / name) for name in ("web", "code")}
    record_mtime = (out / MIXTURE_RECORD).stat().st_mtime_ns
    assert prepare_data(config) == record  # nothing changed: nothing rewritten
    assert {name: shard_mtimes(out / name) for name in ("web", "code")} == before
    assert (out / MIXTURE_RECORD).stat().st_mtime_ns == record_mtime

    # a weight change is training's alone; a new source is prepared, the others reused
    config.sources[0].weight = 0.2
    extra = tmp_path / "extra.txt"
    extra.write_text("\n\n".join(f"Extra note {i}." for i in range(12)) + "\n")
    config.sources.append(SourceConfig("extra", [str(extra)], 0.1))
    assert sorted(prepare_data(config)["sources"]) == ["code", "extra", "web"]
    assert {name: shard_mtimes(out / name) for name in ("web", "code")} == before
    assert list(check_prepared(config, tok)) == ["web", "code", "extra"]


def test_a_source_prepared_with_another_tokenizer_is_refused(tmp_path, corpora, tok):
    config = mixture(tmp_path, corpora)
    prepare_data(config)
    code = Path(config.out_dir) / "code"
    other = write_byte_tokenizer(tmp_path / "bytes.tiktoken")
    prepare(PrepareConfig(source=[str(corpora["code"])], text_field="content", tokenizer=str(other),
                          out_dir=str(code), num_proc=1, val_fraction=0.1))  # fmt: skip
    with pytest.raises(ValueError, match=r"^data\.sources\[1\] \(code\): the data in .*code was tokenized by") as err:
        check_prepared(config, tok)
    assert "\n" not in str(err.value)
    config.sources.append(SourceConfig("never", ["x.txt"]))
    config.sources.pop(1)
    with pytest.raises(ValueError, match=r"data\.sources\[1\] \(never\): .*never was never prepared"):
        check_prepared(config, tok)


def test_bad_sources_are_named_before_anything_is_prepared(tmp_path, corpora):
    config = mixture(tmp_path, corpora)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    config.sources.append(SourceConfig("blank", [str(empty)]))
    with pytest.raises(DataError, match=r"data\.sources\[2\] \(blank\): no documents"):
        prepare_data(config)
    config.sources[2] = SourceConfig("gone", [str(tmp_path / "missing*.txt")])
    with pytest.raises(FileNotFoundError, match=r"data\.sources\[2\] \(gone\): no files match"):
        prepare_data(config)
    assert not Path(config.out_dir).exists()  # refused before any source was prepared
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n")
    config.sources[2] = SourceConfig("blank", [str(blank)])
    with pytest.raises(ValueError, match=r"data\.sources\[2\] \(blank\): .*no non-empty documents"):
        prepare_data(config)


def test_a_mixture_never_writes_into_a_single_corpus_folder(tmp_path, corpora):
    single = PrepareConfig(source=[str(corpora["web"])], out_dir=str(tmp_path / "mix"), num_proc=1)
    prepare(single)
    with pytest.raises(FolderNotLanterns, match="holds Lantern's prepared data, not data mixture"):
        prepare_data(mixture(tmp_path, corpora))
