"""Whether a text file is UTF-8, with the file, line and byte offset of the first bad byte when not."""

from __future__ import annotations

import codecs
import gzip
from collections.abc import Callable
from pathlib import Path
from typing import Any

from models.errors import DataError


def check_utf8(path: str | Path) -> None:
    """Raise a DataError naming the file, line and byte offset of the first byte sequence that is not UTF-8
    (a gzip file is checked after decompression; its offsets count decompressed bytes)."""
    opener: Callable[..., Any] = open
    if str(path).endswith(".gz"):
        opener = gzip.open
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:  # the common, valid case at C speed, nothing kept: 64 KiB blocks, whose decoded copies stay in the CPU's
        # cache (16 MiB blocks made checking 100 MB of text ten times slower: 0.35 s against 0.03 s)
        with opener(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 16), b""):
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
