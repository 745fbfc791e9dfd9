"""
Pretraining data preparation: text / JSON / Parquet / hub dataset -> memory-mapped token shards.

Layout of `out_dir` (read by data/packed.py):

    manifest.json               written last: its presence means the data is complete
    train/shard-00000.bin       raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    train/doc_offsets.npy       int64 start of every document in the split's token stream, plus the end
    val/...                     same, for the held-out documents

Documents are the rows of the input (a line / paragraph / file for text inputs, a record for
JSON and Parquet). Each gets BOS/EOS as configured and the splits are the concatenation of their
documents in input order; which documents go to val is a seeded random choice.

`prepare()` is idempotent: the manifest records the tokenizer fingerprint, the settings and the
inputs (size, mtime and sha256), so re-running with nothing changed returns at once, and any change
(a new tokenizer, an edited file, another val_fraction) is named in the log and rebuilds.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from tqdm.auto import tqdm

from data.tokenizer import Tokenizer
from models.errors import DataError

log = logging.getLogger("lantern.prepare")

# Bump when the on-disk layout changes: older data is then rebuilt rather than misread.
MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")
FORMATS = ("auto", "text", "json", "parquet", "hub")
SAMPLE_BY = ("line", "paragraph", "document")

_EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # datasets decompresses these on the fly
_GLOB_CHARS = set("*?[")
# Settings that do not change the bytes written: changing them must not trigger a rebuild.
# (The tokenizer is compared by fingerprint, so "default" and its file path count as the same.)
_NON_DATA_SETTINGS = {"num_proc", "out_dir", "tokenizer", "source"}


@dataclass
class PrepareConfig:
    source: list[str] = field(default_factory=lambda: ["data/corpus/tinyshakespeare.txt"])
    format: str = "auto"  # text | json (also jsonl) | parquet | hub | auto (by file extension)
    text_field: str = "text"  # json / parquet / hub column holding the document text
    sample_by: str = "paragraph"  # text files: one document per line | paragraph | document (file)
    tokenizer: str = "default"
    out_dir: str = "runs/data/shakespeare"
    val_fraction: float = 0.05  # fraction of documents held out for validation
    seed: int = 1234
    num_proc: int = 2
    add_bos: bool = True
    add_eos: bool = True
    shard_tokens: int = 2**27  # tokens per shard file (256 MiB of uint16)


# -----------------------------------------------------------------------------
# manifest


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest little-endian unsigned dtype that holds every id."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def read_manifest(data_dir: str | Path) -> dict:
    """The manifest of a prepared data dir; ValueError if there is none (never prepared, or interrupted)."""
    path = Path(data_dir) / MANIFEST_NAME
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"no {MANIFEST_NAME} in {data_dir}: the data was never prepared there or the preparation was "
            "interrupted; run `lantern prepare` first"
        ) from None


def check_manifest(data_dir: str | Path, tokenizer: Tokenizer | str) -> dict:
    """For training code: the manifest of `data_dir`, after checking the data was tokenized by `tokenizer`
    (a Tokenizer or a spec for Tokenizer.load). Token ids from another tokenizer would silently train garbage."""
    manifest = read_manifest(data_dir)
    if isinstance(tokenizer, str):
        tokenizer = Tokenizer.load(tokenizer)
    prepared = manifest["tokenizer"]
    if prepared["fingerprint"] != tokenizer.fingerprint:
        raise ValueError(
            f"the data in {data_dir} was tokenized by {prepared['spec']!r} (fingerprint {prepared['fingerprint']}) "
            f"but training uses {tokenizer.path!r} (fingerprint {tokenizer.fingerprint}); "
            "re-run `lantern prepare` with this tokenizer, or train with the one the data was prepared with"
        )
    return manifest


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# inputs


C = TypeVar("C")


def normalize_dataclass(
    cls: type[C], config: C | Mapping[str, Any], list_fields: Sequence[str], validate: Callable[[C], None]
) -> C:
    """A validated copy of `config` as a plain `cls` (callers may pass a `cls`, a dict or an OmegaConf-built
    object), shared by the data configs (prepare, SFT, preference). Each of `list_fields` becomes a list of str:
    a bare string would be iterated character by character, and OmegaConf hands over a ListConfig."""
    if isinstance(config, cls):
        config = dataclasses.asdict(config)
    config = cls(**dict(config))
    for name in list_fields:
        value = getattr(config, name)
        setattr(config, name, [value] if isinstance(value, str) else [str(v) for v in value])
    validate(config)
    return config


def _normalize_config(config: PrepareConfig | dict) -> PrepareConfig:
    """A validated copy with plain Python types (callers may pass a dict or an OmegaConf-built object)."""
    return normalize_dataclass(PrepareConfig, config, ("source",), _validate_config)


def _validate_config(config: PrepareConfig) -> None:
    if not config.source:
        raise ValueError("prepare: `source` is empty; give at least one file, glob or hub dataset name")
    if config.format not in FORMATS:
        raise ValueError(f"unknown format {config.format!r}; expected one of {', '.join(FORMATS)}")
    if config.sample_by not in SAMPLE_BY:
        raise ValueError(f"unknown sample_by {config.sample_by!r}; expected one of {', '.join(SAMPLE_BY)}")
    if not 0.0 <= config.val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {config.val_fraction}")
    if config.shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {config.shard_tokens}")
    if config.num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {config.num_proc}")


def _format_of(path: str) -> str | None:
    name = path.lower()
    for ext in _COMPRESSION:
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    return _EXTENSIONS.get(os.path.splitext(name)[1])


def resolve_inputs(config: PrepareConfig) -> tuple[str, list[str]]:
    """(format, files): expand globs, check every file exists, pick the format. Hub: (hub, [name])."""
    if config.format == "hub":
        if len(config.source) != 1:
            raise ValueError(f"format 'hub' takes one dataset name in `source`, got {config.source}")
        return "hub", list(config.source)

    files: list[str] = []
    for pattern in config.source:
        expanded = os.path.expanduser(pattern)
        if _GLOB_CHARS & set(expanded):
            matches = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"no files match {pattern!r}")
            files.extend(matches)
        elif os.path.isdir(expanded):
            raise ValueError(f"input {pattern!r} is a directory; give files or a glob such as '{pattern}/*.txt'")
        elif not os.path.isfile(expanded):
            hint = ""
            if config.format == "auto" and "/" in pattern and not os.path.splitext(pattern)[1]:
                hint = " (for a Hugging Face hub dataset, set format: hub)"
            raise FileNotFoundError(f"input file not found: {pattern}{hint}")
        else:
            files.append(expanded)
    files = [os.path.abspath(f) for f in dict.fromkeys(files)]  # drop duplicates, keep order

    if config.format != "auto":
        return config.format, files
    formats = {f: _format_of(f) for f in files}
    unknown = [f for f, fmt in formats.items() if fmt is None]
    if unknown:
        raise ValueError(
            f"cannot tell the format of {unknown[0]} from its extension; set format to text, json or parquet"
        )
    kinds = sorted(set(formats.values()))
    if len(kinds) > 1:
        raise ValueError(f"inputs mix formats ({', '.join(kinds)}); prepare each format separately or set format")
    return kinds[0], files


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def describe_inputs(files: list[str], with_hash: bool = True) -> list[dict]:
    inputs = []
    for path in files:
        st = os.stat(path)
        entry = {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if with_hash:
            entry["sha256"] = _sha256(path)
        inputs.append(entry)
    return inputs


# -----------------------------------------------------------------------------
# staleness


def _data_settings(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in _NON_DATA_SETTINGS}


def _inputs_changed(old: list[dict], files: list[str]) -> tuple[str | None, bool]:
    """(reason the inputs differ or None, whether only mtimes moved). A file whose size matches but
    whose mtime moved (a checkout, a copy) is hashed: same content counts as unchanged."""
    old_paths = [entry["path"] for entry in old]
    if old_paths != files:
        added = [p for p in files if p not in old_paths]
        removed = [p for p in old_paths if p not in files]
        parts = [f"added {added}" if added else "", f"removed {removed}" if removed else ""]
        return "inputs changed: " + (", ".join(p for p in parts if p) or "file order differs"), False
    touched = False
    for entry in old:
        st = os.stat(entry["path"])
        if st.st_size != entry["size"]:
            return f"input changed: {entry['path']} (size {entry['size']} → {st.st_size})", False
        if st.st_mtime_ns != entry.get("mtime_ns"):
            if entry.get("sha256") != _sha256(entry["path"]):
                return f"input changed: {entry['path']} (content differs)", False
            touched = True
    return None, touched


def _split_files_ok(out_dir: Path, manifest: dict) -> str | None:
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            path = out_dir / split / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * itemsize:
                return f"shard {path} is missing or has the wrong size"
        if not (out_dir / split / "doc_offsets.npy").is_file():
            return f"{out_dir / split / 'doc_offsets.npy'} is missing"
    return None


def stale_reason(
    config: PrepareConfig, tokenizer: Tokenizer, files: list[str] | None
) -> tuple[str | None, dict | None]:
    """(why `out_dir` must be rebuilt or None, the existing manifest). files=None for hub inputs,
    whose identity is checked separately (it needs the dataset loaded)."""
    out_dir = Path(config.out_dir)
    try:
        old = read_manifest(out_dir)
    except json.JSONDecodeError:  # (a ValueError too: catch it first)
        return f"{out_dir / MANIFEST_NAME} is unreadable", None
    except ValueError:
        return f"no complete prepared data in {out_dir}", None
    if old.get("version") != MANIFEST_VERSION:
        return f"data layout version changed: {old.get('version')} → {MANIFEST_VERSION}", old
    old_tok = old["tokenizer"]
    if old_tok["fingerprint"] != tokenizer.fingerprint:
        return (
            f"tokenizer changed: {old_tok['spec']} ({old_tok['fingerprint'][:12]}) → "
            f"{config.tokenizer} ({tokenizer.fingerprint[:12]})"
        ), old
    old_settings = _data_settings(old["settings"])
    new_settings = _data_settings(dataclasses.asdict(config))
    if old_settings != new_settings:
        diffs = [
            f"{k}: {old_settings.get(k)!r} → {new_settings.get(k)!r}"
            for k in sorted(set(old_settings) | set(new_settings))
            if old_settings.get(k) != new_settings.get(k)
        ]
        return "settings changed: " + ", ".join(diffs), old
    if files is not None:
        reason, touched = _inputs_changed(old["inputs"], files)
        if reason:
            return reason, old
        if touched:  # same content, new mtimes: refresh them so the next check is cheap again
            old["inputs"] = [{**entry, "mtime_ns": os.stat(entry["path"]).st_mtime_ns} for entry in old["inputs"]]
            _write_json_atomic(out_dir / MANIFEST_NAME, old)
    return _split_files_ok(out_dir, old), old


# -----------------------------------------------------------------------------
# loading and validation (all before tokenizing)


def _load(fmt: str, files: list[str], config: PrepareConfig, cache_dir: str, utf8_checked: bool = False):
    from datasets import load_dataset  # heavy import, only when there is work to do
    from datasets.exceptions import DatasetGenerationError

    if fmt == "hub":
        name, _, subset = files[0].partition(":")  # "owner/name:subset" picks a configuration
        # Hub downloads go to the regular HF cache (worth keeping); only derived files go to cache_dir.
        return load_dataset(name, subset or None, split="train")
    # Multiple processes only help when there are several files to convert.
    num_proc = min(config.num_proc, len(files)) if len(files) > 1 else None
    kwargs: dict[str, Any] = {}
    if fmt == "text":
        kwargs["sample_by"] = config.sample_by
    if all(os.path.getsize(f) == 0 for f in files):  # datasets would fail with a schema-inference error
        where = files[0] if len(files) == 1 else f"all {len(files)} input files ({files[0]}, ...)"
        raise ValueError(f"empty corpus: no non-empty documents in {where} (0 bytes)")
    if fmt in ("text", "json") and not utf8_checked:  # pyarrow's JSON reader passes bad bytes through
        for path in files:
            check_utf8(path)
    try:
        return load_dataset(fmt, data_files=files, split="train", cache_dir=cache_dir, num_proc=num_proc, **kwargs)
    except (DatasetGenerationError, UnicodeDecodeError) as error:
        # datasets names the failing file only in its log; find it ourselves where we can.
        located = _diagnose_json(files, config.text_field) if fmt == "json" else None
        cause = error.__cause__ or error
        raise ValueError(f"cannot read the {fmt} input: {located or f'{type(cause).__name__}: {cause}'}") from error


def check_utf8(path: str | Path) -> None:
    """Raise a DataError naming the file, line and byte offset of the first byte sequence that is not UTF-8
    (a gzip file is checked after decompression; its offsets count decompressed bytes)."""
    opener: Callable[..., Any] = open
    if str(path).endswith(".gz"):
        import gzip

        opener = gzip.open
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:  # the common, valid case at C speed: 16 MiB blocks, nothing kept
        with opener(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                decoder.decode(block)
        decoder.decode(b"", final=True)
        return
    except UnicodeDecodeError:
        pass
    offset = 0
    with opener(path, "rb") as f:
        # "\n" never occurs inside a multi-byte UTF-8 sequence, so lines can be decoded one at a time
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                bad = raw[error.start : error.start + 4]
                raise DataError(
                    f"{path}: line {lineno}, byte offset {offset + error.start}: not valid UTF-8 ({bad!r}: "
                    f"{error.reason}); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            offset += len(raw)
    raise DataError(f"{path}: not valid UTF-8 (it ends inside a multi-byte character at byte offset {offset})")


def _json_rows(path: str):
    """(location, record or JSONDecodeError) for each record of a JSON array / JSON lines file."""
    opener = open
    if path.endswith(".gz"):
        import gzip

        opener = gzip.open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    try:  # a JSON document: a list of records, or a dict holding one
        records = json.loads(text)
        if isinstance(records, dict):
            records = next((v for v in records.values() if isinstance(v, list)), [records])
        if isinstance(records, list):
            yield from ((f"{path}, record {i + 1}", r) for i, r in enumerate(records))
            return
    except json.JSONDecodeError:
        pass
    for lineno, line in enumerate(text.splitlines(), start=1):  # JSON lines
        if line.strip():
            try:
                yield f"{path}, line {lineno}", json.loads(line)
            except json.JSONDecodeError as error:
                yield f"{path}, line {lineno}", error


def _diagnose_json(files: list[str], text_field: str) -> str | None:
    """Error path only: the first JSON row that is malformed or lacks a string `text_field`, with its
    file and line (the datasets error does not say where)."""
    for path in files:
        for where, record in _json_rows(path):
            if isinstance(record, json.JSONDecodeError):
                return f"{where}: invalid JSON ({record.msg})"
            if not isinstance(record, dict):
                return f"{where}: expected an object with a {text_field!r} field, got {type(record).__name__}"
            if text_field not in record:
                return f"{where}: row has no {text_field!r} field (keys: {sorted(record)})"
            if not isinstance(record[text_field], str):
                return f"{where}: {text_field!r} is {type(record[text_field]).__name__}, not a string"
    return None


def _locate_row(files: list[str], fmt: str, row: int) -> str:
    """Map a global row index to 'file, row N' (1-based) for error messages."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        for path in files:
            n = pq.ParquetFile(path).metadata.num_rows
            if row < n:
                return f"{path}, row {row + 1}"
            row -= n
    return f"row {row + 1} of {files}"


def validate_dataset(ds, fmt: str, files: list[str], text_field: str) -> int:
    """Check the text column before spending time on tokenization. Returns the non-empty document count."""
    import pyarrow as pa
    import pyarrow.compute as pc

    where = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
    if text_field not in ds.column_names:
        located = _diagnose_json(files, text_field) if fmt == "json" else None
        raise ValueError(
            f"no {text_field!r} field in {located or where}; available fields: {ds.column_names}; set text_field"
        )
    column = ds.data.column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        located = _diagnose_json(files, text_field) if fmt == "json" else None
        raise ValueError(f"field {text_field!r} must hold text: {located or f'{where} holds {column.type}'}")
    if column.null_count:
        first_null = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        located = _diagnose_json(files, text_field) if fmt == "json" else None
        located = located or _locate_row(files, fmt, first_null)
        raise ValueError(f"{column.null_count} row(s) without a {text_field!r} string; the first: {located}")
    non_empty = pc.sum(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0)).as_py() or 0
    if non_empty == 0:
        raise ValueError(f"empty corpus: no non-empty documents in {where}")
    return non_empty


# -----------------------------------------------------------------------------
# tokenization and shard writing


def _tokenize_batch(batch, *, tokenizer: Tokenizer, text_field: str, bos: bool, eos: bool, strip_newlines: bool):
    """Arrow batch of texts -> Arrow table with one `ids` list per non-empty document."""
    import pyarrow as pa

    # Whitespace-only documents would add nothing but BOS/EOS pairs: drop them (a batched map may
    # return fewer rows than it got).
    texts = [t for t in batch.column(text_field).to_pylist() if t and not t.isspace()]
    if strip_newlines:
        # Paragraph splitting on "\n\n" leaves stray newlines at a file's end or after 3+ blank
        # lines; without stripping, identical paragraphs would tokenize differently by position.
        texts = [t.strip("\n") for t in texts]
    # One thread: parallelism comes from num_proc, and a thread pool per ~1000-document batch
    # costs more than it gains.
    encoded = tokenizer.encode_batch(texts, num_threads=1)
    # Build the Arrow list column from flat values + offsets (letting Arrow convert nested Python
    # lists costs about as much as tokenizing), and place BOS/EOS with numpy rather than by
    # concatenating a Python list per document.
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) + int(bos) + int(eos)
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=np.int32)
    is_text = np.ones(len(values), dtype=bool)
    if bos:
        values[offsets[:-1]] = tokenizer.bos_id
        is_text[offsets[:-1]] = False
    if eos:
        values[offsets[1:] - 1] = tokenizer.eos_id
        is_text[offsets[1:] - 1] = False
    values[is_text] = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=int(is_text.sum()))
    ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return pa.table({"ids": ids})


class _ShardWriter:
    """Appends documents to fixed-size raw shard files and records document offsets."""

    def __init__(self, split_dir: Path, dtype: np.dtype, shard_tokens: int):
        self.dir, self.dtype, self.shard_tokens = split_dir, dtype, shard_tokens
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shards: list[dict] = []
        self.lengths: list[np.ndarray] = []
        self._file = None
        self.tokens = 0

    def add(self, values: np.ndarray, lengths: np.ndarray) -> None:
        self.lengths.append(lengths.astype(np.int64, copy=False))
        values = values.astype(self.dtype, copy=False)
        while len(values):
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, values = values[:room], values[room:]
            part.tofile(self._file)
            self.shards[-1]["tokens"] += len(part)
            self.tokens += len(part)

    def _open_next(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"shard-{len(self.shards):05d}.bin"
        self._file = open(self.dir / name, "wb")  # noqa: SIM115 - stays open across appends; closed by close()
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> dict:
        if self._file is not None:
            self._file.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(self.dir / "doc_offsets.npy", offsets)
        return {"tokens": int(offsets[-1]), "documents": len(lengths), "shards": self.shards}


def _choose_val(num_docs: int, config: PrepareConfig) -> np.ndarray:
    """Boolean mask of held-out documents: a seeded choice, so the same inputs give the same split."""
    n_val = round(num_docs * config.val_fraction)
    if config.val_fraction > 0:
        n_val = max(n_val, 1)  # a requested validation split is never silently empty
    if n_val >= num_docs:
        raise ValueError(
            f"cannot hold out {n_val} of {num_docs} documents for validation and keep any for training: "
            "lower val_fraction (0 disables validation), add data, or use a finer sample_by (line/paragraph)"
        )
    mask = np.zeros(num_docs, dtype=bool)
    mask[np.random.default_rng(config.seed).choice(num_docs, size=n_val, replace=False)] = True
    return mask


def _write_splits(tokens_ds, config: PrepareConfig, dtype: np.dtype, build_dir: Path) -> dict:
    import pyarrow.compute as pc

    table = tokens_ds.data.table if hasattr(tokens_ds.data, "table") else tokens_ds.data
    num_docs = table.num_rows
    if num_docs == 0:
        raise ValueError(f"empty corpus: no non-empty documents in {config.source}")
    is_val = _choose_val(num_docs, config)
    writers = {s: _ShardWriter(build_dir / s, dtype, config.shard_tokens) for s in SPLITS}
    row = 0
    from datasets.utils.logging import is_progress_bar_enabled

    # One switch for all bars: datasets.disable_progress_bars() also silences this one.
    with tqdm(total=num_docs, unit="doc", desc="writing shards", disable=not is_progress_bar_enabled()) as bar:
        # Arrow list columns are already (flat values, offsets): no per-document Python work here.
        for batch in table.to_batches(max_chunksize=65536):
            ids = batch.column(0)
            lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
            values = ids.flatten().to_numpy(zero_copy_only=False)
            val_docs = is_val[row : row + len(lengths)]
            val_tokens = np.repeat(val_docs, lengths)
            writers["train"].add(values[~val_tokens], lengths[~val_docs])
            writers["val"].add(values[val_tokens], lengths[val_docs])
            row += len(lengths)
            bar.update(len(lengths))
    return {s: w.close() for s, w in writers.items()}


def _clean_stale_build_dirs(out_dir: Path) -> None:
    """Remove build dirs left by prepares that died (the pid in the name is no longer running)."""
    for path in out_dir.glob(".prepare-*"):
        try:
            pid = int(path.name.split("-")[1])
            os.kill(pid, 0)
            continue  # still running (another prepare): leave it alone
        except (ValueError, IndexError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        log.info("removing leftover build dir %s", path)
        shutil.rmtree(path, ignore_errors=True)


def _install(build_dir: Path, out_dir: Path, manifest: dict) -> None:
    """Swap the new splits into place; the manifest goes last so a crash never leaves one that looks complete."""
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # from here the old data is no longer valid
    for split in SPLITS:
        target = out_dir / split
        if target.exists():
            target.rename(build_dir / f"old-{split}")
        (build_dir / split).rename(target)
    _write_json_atomic(out_dir / MANIFEST_NAME, manifest)


def prepare(config: PrepareConfig | dict) -> dict:
    """Tokenize `config.source` into `config.out_dir` (see module docstring). Returns the manifest.
    Does nothing if the data there is already up to date."""
    config = _normalize_config(config)
    tokenizer = Tokenizer.load(config.tokenizer)
    fmt, files = resolve_inputs(config)  # FileNotFoundError before anything is loaded
    out_dir = Path(config.out_dir)

    reason, old = stale_reason(config, tokenizer, None if fmt == "hub" else files)
    if reason is None and fmt != "hub":
        log.info(
            "prepared data in %s is up to date (%s train tokens); nothing to do",
            out_dir,
            f"{old['splits']['train']['tokens']:,}",
        )
        return old

    if fmt in ("text", "json"):  # a mis-encoded input is named before anything is created or loaded
        for path in files:
            check_utf8(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    _clean_stale_build_dirs(out_dir)
    build_dir = out_dir / f".prepare-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    build_dir.mkdir()
    try:
        t0 = time.perf_counter()
        # Stat and hash the inputs before reading them: a file edited while we work then looks
        # changed on the next run instead of silently matching stale shards.
        inputs = describe_inputs(files) if fmt != "hub" else []
        ds = _load(fmt, files, config, cache_dir=str(build_dir / "hf-cache"), utf8_checked=True)
        if fmt == "hub":
            # A hub dataset has no file stats: its identity is the datasets fingerprint of the cached build.
            inputs = [{"path": files[0], "fingerprint": ds._fingerprint}]
            if reason is None and old["inputs"] == inputs:
                log.info("prepared data in %s is up to date; nothing to do", out_dir)
                return old
            reason = reason or f"inputs changed: {old['inputs']} → {inputs}"
        log.info("preparing %s: %s", out_dir, reason)

        text_field = "text" if fmt == "text" else config.text_field  # the text builder always names it "text"
        non_empty = validate_dataset(ds, fmt, files, text_field)
        if config.val_fraction > 0 and non_empty < 2:
            _choose_val(non_empty, config)  # raises the "cannot hold out" error before tokenizing

        from datasets import Features, List, Value

        tokens_ds = ds.with_format("arrow").map(
            _tokenize_batch,
            batched=True,
            batch_size=1000,
            num_proc=config.num_proc if config.num_proc > 1 and len(ds) > 1 else None,
            remove_columns=ds.column_names,
            features=Features({"ids": List(Value("int32"))}),
            fn_kwargs=dict(
                tokenizer=tokenizer,
                text_field=text_field,
                bos=config.add_bos,
                eos=config.add_eos,
                strip_newlines=fmt == "text" and config.sample_by == "paragraph",
            ),
            cache_file_name=str(build_dir / "hf-cache" / "tokens.arrow"),
            # An explicit fingerprint spares datasets from hashing the tokenizer's rank table.
            new_fingerprint=hashlib.sha256(
                f"{ds._fingerprint}|{tokenizer.fingerprint}|{text_field}|{config}".encode()
            ).hexdigest()[:32],
            desc="tokenizing",
        )
        dtype = token_dtype(tokenizer.vocab_size)
        splits = _write_splits(tokens_ds, config, dtype, build_dir)
        del ds, tokens_ds  # release the memory maps before the cache is deleted

        manifest = {
            "version": MANIFEST_VERSION,
            "tokenizer": {
                "spec": config.tokenizer,
                "fingerprint": tokenizer.fingerprint,
                "vocab_size": tokenizer.vocab_size,
            },
            "inputs": inputs,
            "settings": dataclasses.asdict(config),
            "dtype": dtype.name,
            "splits": splits,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(time.perf_counter() - t0, 3),
        }
        _install(build_dir, out_dir, manifest)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    train, val = splits["train"], splits["val"]
    log.info(
        "wrote %s: train %s tokens / %s docs, val %s tokens / %s docs (%s) in %.1fs",
        out_dir,
        f"{train['tokens']:,}",
        f"{train['documents']:,}",
        f"{val['tokens']:,}",
        f"{val['documents']:,}",
        dtype.name,
        manifest["seconds"],
    )
    return manifest
