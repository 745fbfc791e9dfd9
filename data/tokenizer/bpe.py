"""
Train a byte-level BPE tokenizer and write it as a tiktoken rank file.

The heavy lifting is done by rustbpe (Rust, parallel, GPT-4-style byte-level
BPE whose ranks are directly usable by tiktoken). We only stream the corpus in,
validate the result and write "<base64 token> <rank>" lines atomically.

    from data.tokenizer.bpe import train_bpe
    train_bpe("data/corpus/tinyshakespeare.txt", vocab_size=4096, out="tok.tiktoken")
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import rustbpe
from tqdm import tqdm

from data.tokenizer.base import check_utf8
from data.tokenizer.tokenizer import LLAMA3_PAT, NUM_SPECIAL_TOKENS, Tokenizer
from models.errors import DataError
from models.files.atomic import write_atomically

log = logging.getLogger(__name__)
rust_log = logging.getLogger("rustbpe")

CHUNK_CHARS = 1 << 16  # strings handed to rustbpe; lets it spread counting over cores
PROGRESS_MIN_BYTES = 32 << 20  # show a progress bar only for corpora big enough to wait on
SANITY_CHARS = 1 << 16  # round-trip this much of the corpus through the written file


def _corpus_files(corpus: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    items = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    if not items:
        raise ValueError("corpus is an empty list of paths")
    files: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.txt") if q.is_file())
            if not found:
                raise ValueError(f"corpus directory {p} contains no .txt files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"corpus file not found: {p}")
    return files


def _iter_chunks(files: list[Path], bar: tqdm) -> Iterator[str]:
    """Yield ~CHUNK_CHARS pieces of text, never crossing a file boundary.

    A chunk only ends right before a line that starts with non-whitespace. The
    Llama 3 / cl100k pre-tokenizer never puts a newline and a following
    non-space char in the same piece, so chunking there yields exactly the same
    pieces (and merge counts) as feeding whole files.
    """
    for f in files:
        try:
            # newline="" keeps "\r\n" as-is: train on the bytes the tokenizer will actually see
            with open(f, encoding="utf-8", newline="") as fh:
                buf: list[str] = []
                size = 0
                for line in fh:
                    if size >= CHUNK_CHARS and not line[:1].isspace():
                        chunk = "".join(buf)
                        bar.update(len(chunk.encode("utf-8")))
                        yield chunk
                        buf, size = [], 0
                    buf.append(line)
                    size += len(line)
                if buf:
                    chunk = "".join(buf)
                    bar.update(len(chunk.encode("utf-8")))
                    yield chunk
        except UnicodeDecodeError:
            check_utf8(f)  # names the line and byte offset
            raise


def _drop_info(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def _train_ranks(files: list[Path], n_ranks: int, pattern: str, total_bytes: int) -> list[bytes]:
    """Run rustbpe; return token bytes in rank order (duplicates removed)."""
    target = n_ranks
    for _ in range(4):
        bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            desc="bpe: counting",
            disable=total_bytes < PROGRESS_MIN_BYTES,
        )
        trainer = rustbpe.Tokenizer()
        # rustbpe logs ~100 merge-progress lines at INFO: useful on a big corpus, noise on a small one.
        # (A filter, not setLevel: pyo3-log caches levels but filters run on every record.)
        if total_bytes < PROGRESS_MIN_BYTES:
            rust_log.addFilter(_drop_info)
        try:
            with bar:
                trainer.train_from_iterator(_iter_chunks(files, bar), target, pattern=pattern)
        finally:
            rust_log.removeFilter(_drop_info)
        pairs = sorted(trainer.get_mergeable_ranks(), key=lambda kv: kv[1])
        # Two different merges can in principle spell the same bytes; tiktoken maps
        # bytes -> rank, so keep the first (higher-priority) one and renumber.
        tokens = list(dict.fromkeys(tok for tok, _ in pairs))
        if len(tokens) >= n_ranks:
            return tokens[:n_ranks]
        if len(pairs) < target:  # no pair left to merge
            names = ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
            raise ValueError(
                f"corpus too small for vocab_size {n_ranks + NUM_SPECIAL_TOKENS}: BPE ran out of pairs "
                f"after {len(tokens)} of {n_ranks} ranks ({names})"
            )
        target += n_ranks - len(tokens)  # lost some to duplicates: train a little further
    raise RuntimeError(f"could not reach {n_ranks} unique BPE tokens")


def trained_here(path: Path) -> bool:
    """Whether ``path`` is a rank file this module wrote: its first 256 ranks are the single bytes in byte order
    (rustbpe's start, checked before writing). Meta's and OpenAI's files, like any other file, are not."""
    try:
        with open(path, "rb") as handle:
            lines = [handle.readline() for _ in range(256)]
        return all(line.split() == [base64.b64encode(bytes([rank])), b"%d" % rank] for rank, line in enumerate(lines))
    except OSError:
        return False


def check_output_file(out: str | os.PathLike, *, flag: str = "out") -> Path:
    """``out`` must name a file that can be written: not an existing folder, not under a file."""
    path = Path(out).expanduser()
    if path.is_dir():
        raise DataError(f"{flag} {path} is a folder; pass a file path such as {path / 'tokenizer.tiktoken'}")
    if path.exists() and not trained_here(path):
        raise DataError(
            f"{flag} {path} exists and is not a tokenizer trained by `lantern tokenizer train`: refusing to replace "
            "it; pass a new file path"
        )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"{flag} {path}: {parent} is a file, not a folder")
            if not os.access(parent, os.W_OK):
                raise DataError(f"{flag} {path}: folder {parent} is not writable")
            break
    return path


def train_bpe(
    corpus: str | os.PathLike | Sequence[str | os.PathLike],
    vocab_size: int,
    out: str | os.PathLike,
    pattern: str = LLAMA3_PAT,
) -> Path:
    """Train byte-level BPE on UTF-8 text file(s) (or directories of .txt files) and
    write a tiktoken rank file. vocab_size counts the 256 special tokens too, so the
    file gets vocab_size - 256 ranks (the first 256 are the single bytes)."""
    t0 = time.time()
    min_vocab = 256 + 1 + NUM_SPECIAL_TOKENS
    if not isinstance(vocab_size, int) or vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size!r} too small: need >= {min_vocab} "
            f"(256 byte tokens + at least 1 merge + {NUM_SPECIAL_TOKENS} special tokens)"
        )
    out = check_output_file(out)
    files = _corpus_files(corpus)
    total_bytes = sum(f.stat().st_size for f in files)
    if total_bytes == 0:
        raise ValueError(f"corpus is empty: {', '.join(str(f) for f in files)}")
    n_ranks = vocab_size - NUM_SPECIAL_TOKENS
    log.info("bpe: training %d ranks on %d file(s), %.1f MB", n_ranks, len(files), total_bytes / 1e6)

    tokens = _train_ranks(files, n_ranks, pattern, total_bytes)
    # rustbpe starts from the 256 single bytes in byte order; tiktoken relies on all of them existing.
    if tokens[:256] != [bytes([b]) for b in range(256)]:
        raise RuntimeError("rustbpe did not emit the 256 single-byte tokens as ranks 0..255")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, b"".join(base64.b64encode(tok) + b" %d\n" % rank for rank, tok in enumerate(tokens)))

    # Cheap end-to-end check that the written file loads and round-trips real text.
    first = next(f for f in files if f.stat().st_size > 0)
    with open(first, encoding="utf-8", newline="") as fh:
        sample = fh.read(SANITY_CHARS)
    tok = Tokenizer.from_file(out, pat_str=pattern)
    if tok.decode(tok.encode(sample)) != sample:
        raise RuntimeError(f"trained tokenizer {out} failed to round-trip its own corpus")

    log.info(
        "bpe: vocab %d (%d ranks + %d specials) in %.2fs -> %s",
        tok.vocab_size,
        n_ranks,
        NUM_SPECIAL_TOKENS,
        time.time() - t0,
        out,
    )
    return out
