"""
One input file of the SFT, preference and prompt loaders: its rows, where each one is, and the rows as written.
"""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import tempfile
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from data.pretrain.config import PrepareConfig
from data.pretrain.sources import load_source
from models.errors import DataError

log = logging.getLogger("lantern.data")

# The compressions Python reads itself (datasets knows more: those files get "row N" locations and no exact rows).
_OPENERS: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_OTHER_COMPRESSION = (".zst", ".lz4")


def _opener(path: str) -> Callable[..., Any] | None:
    name = path.lower()
    if name.endswith(_OTHER_COMPRESSION):
        return None
    return next((opener for ext, opener in _OPENERS.items() if name.endswith(ext)), open)


@dataclass
class JsonLayout:
    """Where the records of a JSON file are: the elements of one array, or its non-blank lines."""

    path: str
    array: bool  # one JSON array (its elements are the rows), else JSON lines
    lines: array = field(default_factory=lambda: array("q"))  # JSON lines: each row's 1-based line number
    offsets: array = field(default_factory=lambda: array("q"))  # and its byte offset, to read it again alone
    _rows: list[Any] | None = None

    def where(self, index: int) -> str:
        return f"{self.path}, record {index + 1}" if self.array else f"{self.path}, line {self.lines[index]}"

    def rows(self) -> list[Any]:
        """Every row as written; a line that is not JSON raises a DataError naming it."""
        if self._rows is None:
            opener = _opener(self.path)
            assert opener is not None  # scan_json gives no layout for what Python cannot open
            with opener(self.path, "rb") as f:
                if self.array:
                    try:
                        self._rows = json.load(f)
                    except json.JSONDecodeError as error:
                        where = f"{self.path}: line {error.lineno}, column {error.colno}"
                        raise DataError(f"{where}: invalid JSON ({error.msg})") from None
                else:
                    self._rows = [_parse(line, self.path, n) for n, line in enumerate(f, 1) if line.strip()]
        return self._rows

    def row(self, index: int) -> Any:
        """Row `index` as written: a seek to its line (the whole array for an array)."""
        if self.array or self._rows is not None:
            return self.rows()[index]
        opener = _opener(self.path)
        assert opener is not None
        with opener(self.path, "rb") as f:
            f.seek(self.offsets[index])
            return _parse(f.readline(), self.path, self.lines[index])


def _parse(line: bytes, path: str, lineno: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}, line {lineno}: invalid JSON ({error.msg})") from None


def scan_json(path: str) -> JsonLayout | None:
    """The layout of a JSON / JSON lines file (None for a compression Python cannot read); a file with nothing
    but blank lines (or 0 bytes) is a DataError naming it: `datasets` would say "corresponds to no data!"."""
    opener = _opener(path)
    if opener is None:
        return None
    layout = JsonLayout(path, array=False)
    offset = 0
    with opener(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                if not layout.lines and line.lstrip().startswith(b"["):
                    return JsonLayout(path, array=True)
                layout.lines.append(lineno)
                layout.offsets.append(offset)
            offset += len(line)
    if not layout.lines:
        held = "it is empty (0 bytes)" if offset == 0 else "it holds only blank lines"
        raise DataError(f"{path} has no records: {held}")
    return layout


@dataclass
class RecordFile:
    label: str  # the file, or "hub dataset NAME"
    rows: list[dict[str, Any]]  # as `datasets` gives them (absent fields are null), mixed-type columns exact
    columns: list[str]
    where: list[str]  # each row's location, for messages
    written: Callable[[int], Any] | None  # row i as written in the file (JSON only), to tell null from absent


def _holds_json(feature: Any) -> bool:
    """True when `datasets` typed (part of) a column as Json: its values went through a JSON text round trip."""
    if type(feature).__name__ == "Json":  # by name: not every datasets release has a Json type to import
        return True
    if isinstance(feature, dict):
        return any(_holds_json(f) for f in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_holds_json(f) for f in feature)
    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return inner is not None and _holds_json(inner)


def _as_written(layout: JsonLayout, cause: Exception) -> RecordFile:
    """Every row as written: for a valid JSON file `datasets` could not type (it raised `cause`)."""
    rows = layout.rows()  # raises the DataError naming a line that is not JSON
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{layout.where(index)}: expected a JSON object, got {type(row).__name__}") from cause
    log.debug("%s: datasets could not type the rows (%s); read with Python's json", layout.path, cause)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return RecordFile(layout.path, rows, columns, [layout.where(i) for i in range(len(rows))], layout.row)


def read_records(fmt: str, source: str, num_proc: int = 1) -> RecordFile:
    """The rows of one file (or hub dataset), loaded with `datasets` into a throwaway cache; see the docstring."""
    layout = scan_json(source) if fmt == "json" else None
    label = f"hub dataset {source}" if fmt == "hub" else source
    settings = PrepareConfig(source=[source], format=fmt, num_proc=num_proc)
    with tempfile.TemporaryDirectory(prefix="lantern-sft-") as cache_dir:
        try:
            ds = load_source(fmt, [source], settings, cache_dir=cache_dir)
        except DataError:  # already names the file and line
            raise
        except ValueError as error:
            if layout is None:
                raise
            return _as_written(layout, error)  # a line that is not JSON is named; valid JSON is read as written
        rows, columns = ds.to_list(), list(ds.column_names)
        mixed = [name for name in columns if _holds_json(ds.features[name])]
        del ds  # release the memory-mapped cache before it is deleted
    if not rows:
        raise DataError(f"{label} has no records")
    if layout is not None and not layout.array and len(layout.lines) != len(rows):
        # datasets read the file another way (one pretty-printed document): rows cannot be matched to lines
        layout = None
    if layout is None:
        return RecordFile(label, rows, columns, [f"{label}, row {i + 1}" for i in range(len(rows))], None)
    if mixed and len(layout.rows()) == len(rows):
        for row, exact in zip(rows, layout.rows()):
            if isinstance(exact, dict):
                row.update((name, exact.get(name)) for name in mixed)
    return RecordFile(label, rows, columns, [layout.where(i) for i in range(len(rows))], layout.row)
