"""Reading data inputs (pretraining, SFT, preference): which files, in what format, loaded through `datasets`, and
every problem raised before tokenizing with its file and row (or line and byte offset); ``require_inputs``, the one
check a data config gets where it enters ``data/``; and every worker process ``data/`` forks (reading, tokenizing,
encoding), which dies with the process that started it, however that dies."""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from data.pretrain.config import PrepareConfig
from data.tokenizer.base import check_utf8
from models.config_checks import shipped_path
from models.errors import ConfigError

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
READABLE = ("text", "json", "parquet")  # the file formats (besides hub datasets)
_FOLDER_SCAN = 10_000  # entries of a folder given as an input looked at for what it holds
_GLOB_CHARS = set("*?[")


def _format_of(path: str) -> str | None:
    name = path.lower()
    for ext in _COMPRESSION:
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    return _EXTENSIONS.get(os.path.splitext(name)[1])


def _suffix(name: str) -> str:
    """``.jsonl``, ``.jsonl.gz``: the extension a glob for files like ``name`` ends with."""
    stem, compression = name, ""
    for ext in _COMPRESSION:
        if name.lower().endswith(ext):
            stem, compression = name[: -len(ext)], name[-len(ext) :]
            break
    return os.path.splitext(stem)[1] + compression


def _folder_given(pattern: str, folder: str, fmt: str, formats: Sequence[str]) -> str:
    """The error for a folder given as an input: the globs of the files in it that would be read (the most common
    kind first; ``**/`` when some sit in sub-folders), or which files would be, when it holds none."""
    counts: dict[str, int] = {}
    nested = False
    for index, (_, dirs, names) in enumerate(os.walk(folder)):  # index 0: the folder itself
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if not name.startswith(".") and (fmt != "auto" or _format_of(name) in formats):
                counts[_suffix(name)] = counts.get(_suffix(name), 0) + 1
                nested = nested or index > 0
        if sum(counts.values()) + index >= _FOLDER_SCAN:
            break
    base = pattern.rstrip("/") + ("/**" if nested else "")
    if counts:
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        globs = [f"'{base}/*{ext}' ({n} file{'s' if n > 1 else ''})" for ext, n in ranked]
        return f"input {pattern!r} is a folder; give files or a glob: {' or '.join(globs)}"
    readable = [ext for ext, kind in _EXTENSIONS.items() if kind in formats]
    return (
        f"input {pattern!r} is a folder holding no file to read ({', '.join(readable)}, or those compressed: "
        f"{', '.join(_COMPRESSION)}); give files or a glob"
    )


def require_inputs(inputs: Sequence[str], where: str, key: str) -> None:
    """Refuse an empty list of inputs as ``data/`` receives it: the one data rule load cannot check, since a stage
    may fill the list after load (rejection sampling's samples, the reward model's generated pairs)."""
    if not inputs:
        raise ConfigError(f"{where}: `{key}` is empty; give at least one file, glob or hub dataset name")


def resolve_inputs(config: PrepareConfig, formats: Sequence[str] = READABLE) -> tuple[str, list[str]]:
    """(format, files): expand globs, check every file exists, pick the format. Hub: (hub, [name]). ``formats``:
    those the caller reads, which a folder given instead of files is searched for."""
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
            raise ValueError(_folder_given(pattern, expanded, config.format, formats))
        else:
            found = shipped_path(expanded)  # data/corpus/... names the bundled copy after a plain pip install
            if not found.is_file():
                hint = ""
                if config.format == "auto" and "/" in pattern and not os.path.splitext(pattern)[1]:
                    hint = " (for a Hugging Face hub dataset, set format: hub)"
                raise FileNotFoundError(f"input file not found: {pattern}{hint}")
            files.append(str(found))
    files = [os.path.abspath(f) for f in dict.fromkeys(files)]  # drop duplicates, keep order

    if config.format != "auto":
        return _checked(config.format, files)
    formats = {f: _format_of(f) for f in files}
    unknown = [f for f, fmt in formats.items() if fmt is None]
    if unknown:
        raise ValueError(
            f"cannot tell the format of {unknown[0]} from its extension; set format to text, json or parquet"
        )
    kinds = sorted(set(formats.values()))
    if len(kinds) > 1:
        raise ValueError(f"inputs mix formats ({', '.join(kinds)}); prepare each format separately or set format")
    return _checked(kinds[0], files)


def _checked(fmt: str, files: list[str]) -> tuple[str, list[str]]:
    """(fmt, files), each uncompressed Parquet file checked to be one (it starts and ends with PAR1): pyarrow's
    error for one that is not names no file."""
    for path in files if fmt == "parquet" else ():
        if not path.lower().endswith(".parquet"):
            continue  # compressed (datasets decompresses it first) or named otherwise: read as it comes
        with open(path, "rb") as handle:
            head = handle.read(4)
            handle.seek(max(os.path.getsize(path) - 4, 0))
            tail = handle.read(4)
        if head != b"PAR1" or tail != b"PAR1":
            raise ValueError(f"{path} is not a Parquet file (a Parquet file starts and ends with PAR1)")
    return fmt, files


def load_source(fmt: str, files: list[str], config: PrepareConfig, cache_dir: str, utf8_checked: bool = False):
    from datasets import load_dataset  # deferred: heavy, only when there is work to do (see the docstring)
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
        with workers_die_with_this_process():
            return load_dataset(fmt, data_files=files, split="train", cache_dir=cache_dir, num_proc=num_proc, **kwargs)
    except (DatasetGenerationError, UnicodeDecodeError) as error:
        # datasets names the failing file only in its log; find it ourselves where we can.
        located = _diagnose_json(files, config.text_field) if fmt == "json" else None
        cause = error.__cause__ or error
        raise ValueError(f"cannot read the {fmt} input: {located or f'{type(cause).__name__}: {cause}'}") from error


def json_rows(path: str):
    """(location, record or JSONDecodeError) for each record of a JSON array / JSON lines file."""
    opener = open
    if path.endswith(".gz"):
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
        for where, record in json_rows(path):
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
        import pyarrow.parquet as pq  # deferred: heavy (see the module docstring)

        for path in files:
            n = pq.ParquetFile(path).metadata.num_rows
            if row < n:
                return f"{path}, row {row + 1}"
            row -= n
    return f"row {row + 1} of {files}"


def validate_dataset(ds, fmt: str, files: list[str], text_field: str) -> int:
    """Check the text column before spending time on tokenization. Returns the non-empty document count."""
    import pyarrow as pa  # deferred: heavy (see the module docstring)
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
    # a document is kept when it holds a character other than whitespace: utf8_is_space (true for a non-empty
    # string of whitespace) agrees with Python's str.isspace on every code point, and reads without copying the text
    blank = pc.or_(pc.utf8_is_space(column), pc.equal(pc.binary_length(column), 0))
    non_empty = len(column) - (pc.sum(blank).as_py() or 0)
    if non_empty == 0:
        raise ValueError(f"empty corpus: no non-empty documents in {where}")
    return non_empty


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_active = 0  # how many workers_die_with_this_process blocks are open in this process
_forking: tuple[int, bool] | None = None  # (this pid, forking from the main thread), set just before a fork
_prctl: Callable[..., int] | None = None  # libc's prctl, looked up before any fork (not in a child)


def _before_fork() -> None:
    global _forking
    _forking = (os.getpid(), threading.current_thread() is threading.main_thread()) if _active else None
    if _forking is not None:  # the child starts with SIGTERM blocked: see _in_child
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _in_parent() -> None:
    if _forking is not None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _in_child() -> None:
    if _forking is None:
        return
    parent, from_main_thread = _forking
    # SIGTERM ends a worker at once: it has nothing to save, the process that started it handles the signal. The
    # Python handler it inherited could even ignore it (Lantern's lets a second SIGTERM go by): a pool
    # replacing a worker after the first SIGTERM would fork a child that never stops, and its parent would wait for
    # it forever. Blocked from before the fork until the default is in place, so one sent right away is not lost.
    if callable(signal.getsignal(signal.SIGTERM)):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if not (from_main_thread and _prctl is not None and _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0):
        threading.Thread(target=_exit_when_orphaned, args=(parent,), name="lantern-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was asked for: nobody will send it
        os._exit(1)


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_in_parent, after_in_child=_in_child)


@contextlib.contextmanager
def workers_die_with_this_process() -> Iterator[None]:
    """Inside the block, every process forked from this one (and from those) ends when its parent does."""
    global _active, _prctl
    if _prctl is None and sys.platform == "linux":
        import ctypes  # deferred: only when there are workers to start

        with contextlib.suppress(OSError, AttributeError):
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
    _active += 1
    try:
        yield
    finally:
        _active -= 1
