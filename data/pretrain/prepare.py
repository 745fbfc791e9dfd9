"""
Pretraining data preparation: text / JSON / Parquet / hub dataset -> memory-mapped token shards.

Layout of `out_dir`:

    manifest.json               written last: its presence means the data is complete
    train/shard-00000.bin       raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    train/doc_offsets.npy       int64 start of every document in the split's token stream, plus the end
    val/...                     same, for the held-out documents

Documents are the rows of the input (a line / paragraph / file for text inputs, a record for
JSON and Parquet). Each gets BOS/EOS as configured and the splits are the concatenation of their
documents in input order; which documents go to val is a seeded random choice.

Documents are encoded in batches of about 256 KiB of text, a few ahead of the writer (data/pretrain/batches.py):
with a tiktoken rank file on `num_proc` processes forked from this one; with a tokenizer.json on threads, the
tokenizers library's own thread pool doing the parallel work (it takes every core, or RAYON_NUM_THREADS).

`prepare()` is idempotent: the manifest records the tokenizer fingerprint, the settings and the
inputs (size, mtime and sha256), so re-running with nothing changed returns at once, and any change
(a new tokenizer, an edited file, another val_fraction) is named in the log and rebuilds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from data.pretrain.batches import mapped_in_order, row_batches
from data.pretrain.config import PrepareConfig
from data.pretrain.manifest import MANIFEST_VERSION, describe_inputs, stale_reason, write_json_atomic
from data.pretrain.prepared_folder import (
    BUILD_KIND,
    PREPARED_KIND,
    SPLIT_LISTING,
    SPLITS,
    check_replaceable,
    check_sources_outside,
    clean_stale_build_dirs,
    disk_failure,
    lantern_manifest,
    prepared_by_lantern,
    read_only_data,
)
from data.pretrain.sources import (
    load_source,
    require_inputs,
    resolve_inputs,
    validate_dataset,
    workers_die_with_this_process,
)
from data.streams.shards import MANIFEST_NAME
from data.tokenizer.base import TokenizerBase, check_utf8
from data.tokenizer.tokenizer import Tokenizer
from models.files.atomic import close_lock, storage_error
from models.files.folders import claim_folder, lock_folder, lock_out_readers, release_folder

log = logging.getLogger("lantern.prepare")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest little-endian unsigned dtype that holds every id."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


# -----------------------------------------------------------------------------
# tokenization and shard writing


def _tokenize_batch(
    texts: list[str], *, tokenizer: TokenizerBase, bos: bool, eos: bool, strip_newlines: bool, dtype: np.dtype
) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    """Encode the non-empty texts now; return what gives (their ids, BOS/EOS in place, back to back; each one's
    count): called by the reader, so that the encoder is already on the next batch (data/pretrain/batches.py)."""
    texts = [t for t in texts if _kept(t)]
    if strip_newlines:
        # Paragraph splitting on "\n\n" leaves stray newlines at a file's end or after 3+ blank
        # lines; without stripping, identical paragraphs would tokenize differently by position.
        texts = [t.strip("\n") for t in texts]
    return functools.partial(_pack, tokenizer.start_encode_batch(texts), tokenizer, bos, eos, dtype)


def _pack(
    encoded: Callable[[], list[list[int]]], tokenizer: TokenizerBase, bos: bool, eos: bool, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    # Flat values + lengths straight from the id lists, BOS/EOS placed with numpy rather than by concatenating a
    # Python list per document.
    ids = encoded()
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + int(bos) + int(eos)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=dtype)
    if not (bos or eos):
        values[:] = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=len(values))
        return values, lengths
    is_text = np.ones(len(values), dtype=bool)
    if bos:
        values[offsets[:-1]] = tokenizer.bos_id
        is_text[offsets[:-1]] = False
    if eos:
        values[offsets[1:] - 1] = tokenizer.eos_id
        is_text[offsets[1:] - 1] = False
    values[is_text] = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(is_text.sum()))
    return values, lengths


def _kept(text: str) -> bool:
    # Whitespace-only documents would add nothing but BOS/EOS pairs: dropped (validate_dataset counts the same).
    return bool(text) and not text.isspace()


class Encoded(NamedTuple):
    """The documents to write: how many, and their (token ids, token counts) batch by batch, in input order."""

    documents: int
    batches: Iterable[tuple[np.ndarray, np.ndarray]]


# Text per encode call: big enough that the tokenizers library's thread pool spends next to nothing starting and
# joining; small enough that a batch's lists stay in the CPU's caches: on 2 cores, 256 KiB batches took up to 10%
# less CPU time than 1-2 MiB ones with tiktoken, and the same with a tokenizer.json.
_BATCH_BYTES = 256 << 10


@contextlib.contextmanager
def _encoded(
    column, documents: int, tokenizer: TokenizerBase, config: PrepareConfig, dtype: np.dtype, strip_newlines: bool
) -> Iterator[Encoded]:
    """The column's ``documents`` non-empty documents (validate_dataset's count), encoded batch by batch ahead of
    the writer."""
    # tiktoken encodes on the calling thread: num_proc forked workers (its Python side, the id lists, would
    # serialise threads on the GIL). A tokenizer.json has the tokenizers library's thread pool over all cores: one
    # thread feeds it batch after batch while this one turns each encoded batch into arrays (a second feeding
    # thread took more CPU time: two batches' encodings at once).
    tiktoken = isinstance(tokenizer, Tokenizer)
    processes = tiktoken and config.num_proc > 1 and len(column) > 1
    workers = config.num_proc if processes else 1
    batches = row_batches(column, _BATCH_BYTES, at_least=workers if processes else 1)
    encode = functools.partial(
        _tokenize_batch,  # looked up now: tests replace it
        tokenizer=tokenizer,
        bos=config.add_bos,
        eos=config.add_eos,
        strip_newlines=strip_newlines,
        dtype=dtype,
    )
    with mapped_in_order(encode, column, batches, workers, processes) as results:
        yield Encoded(documents, results)


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


def choose_val(num_docs: int, config: PrepareConfig) -> np.ndarray:
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


def _write_splits(encoded: Encoded, config: PrepareConfig, dtype: np.dtype, build_dir: Path) -> dict:
    from datasets.utils.logging import is_progress_bar_enabled  # deferred: heavy (see the module docstring)

    num_docs = encoded.documents
    if num_docs == 0:
        raise ValueError(f"empty corpus: no non-empty documents in {config.source}")
    is_val = choose_val(num_docs, config)
    writers = {s: _ShardWriter(build_dir / s, dtype, config.shard_tokens) for s in SPLITS}
    row = 0
    # One switch for all bars: datasets.disable_progress_bars() also silences this one.
    with tqdm(total=num_docs, unit="doc", desc="tokenizing", disable=not is_progress_bar_enabled()) as bar:
        for values, lengths in encoded.batches:
            val_docs = is_val[row : row + len(lengths)]
            val_tokens = np.repeat(val_docs, lengths)
            writers["train"].add(values[~val_tokens], lengths[~val_docs])
            writers["val"].add(values[val_tokens], lengths[val_docs])
            row += len(lengths)
            bar.update(len(lengths))
    if row != num_docs:  # validate_dataset's count and the encoding must agree, or the split is not the seeded one
        raise RuntimeError(f"prepare counted {num_docs} documents but encoded {row}")
    return {s: w.close() for s, w in writers.items()}


def _install(build_dir: Path, out_dir: Path, manifest: dict) -> None:
    """Swap the new splits into place; the manifest goes last so a crash never leaves one that looks complete."""
    for split in SPLITS:  # each split lists its files, so a later rebuild knows them even without the manifest
        files = sorted(p.name for p in (build_dir / split).iterdir())
        write_json_atomic(build_dir / split / SPLIT_LISTING, {"files": files})
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # from here the old data is no longer valid
    for split in SPLITS:
        target = out_dir / split
        if target.exists():
            target.rename(build_dir / f"old-{split}")
        (build_dir / split).rename(target)
    write_json_atomic(out_dir / MANIFEST_NAME, manifest)


def prepare(config: PrepareConfig) -> dict:
    """Tokenize `config.source` into `config.out_dir` (see module docstring). Returns the manifest.
    Does nothing if the data there is already up to date."""
    require_inputs(config.source, "prepare", "source")
    tokenizer = Tokenizer.load(config.tokenizer)
    fmt, files = resolve_inputs(config)  # FileNotFoundError before anything is loaded
    out_dir = Path(config.out_dir)

    if fmt != "hub":
        check_sources_outside(out_dir, files)
    # nothing to be up to date with: a mis-encoded input is named before the folder is made (and read only once)
    utf8_checked = fmt in ("text", "json") and not out_dir.exists()
    if utf8_checked:
        for path in files:
            check_utf8(path)
    # Only a folder Lantern prepared (or an empty one) is written into, by one prepare at a time.
    try:
        claim_folder(out_dir, PREPARED_KIND, key="data.out_dir", adopt=prepared_by_lantern)
        lock_folder(
            out_dir, what="data folder", hint="wait for it to finish, stop it, or set data.out_dir to another one"
        )
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        return read_only_data(config, tokenizer, None if fmt == "hub" else files, out_dir, error)
    try:
        # a kill -9 (the OOM killer) of this process must not leave the tokenizing workers running
        with workers_die_with_this_process():
            return _prepare_locked(config, tokenizer, fmt, files, out_dir, utf8_checked)
    except BaseException as error:
        stop = _interruption(error)
        if stop is None:
            raise
        kept = (
            "the data prepared there before is unchanged" if (out_dir / MANIFEST_NAME).exists() else "nothing was kept"
        )
        # a prepare keeps nothing of an unfinished build (it is removed on the way out): the next one starts over
        stop.add_note(
            f"prepare stopped before it finished {out_dir} ({kept}); the same command prepares it from the start"
        )
        if stop is error:
            raise
        raise stop from None
    finally:
        release_folder(out_dir)


def _interruption(error: BaseException) -> BaseException | None:
    """The Ctrl-C or SIGTERM (KeyboardInterrupt, or SystemExit) that ``error`` is, or that was
    being handled when it was raised: ``datasets`` replaces one that stops its worker pool with a TimeoutError of
    its own, empty, while it collects the unfinished jobs."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            return error
        seen.add(id(error))
        error = error.__context__
    return None


def _prepare_locked(
    config: PrepareConfig, tokenizer: TokenizerBase, fmt: str, files: list[str], out_dir: Path, utf8_checked: bool
) -> dict:
    if (out_dir / MANIFEST_NAME).exists() and lantern_manifest(out_dir) is None:
        check_replaceable(out_dir)  # a manifest.json Lantern did not write: refused, never read as stale data
    reason, old = stale_reason(config, tokenizer, None if fmt == "hub" else files)
    if reason is None and fmt != "hub":
        log.info(
            "prepared data in %s is up to date (%s train tokens); nothing to do",
            out_dir,
            f"{old['splits']['train']['tokens']:,}",
        )
        return old

    check_replaceable(out_dir)
    # a run reading this folder would go on over other data, or die on half-replaced files: refused, naming it
    readers = lock_out_readers(
        out_dir, what="data folder", hint="let it finish or stop it, or set data.out_dir to another folder"
    )
    try:
        return _rebuild(config, tokenizer, fmt, files, out_dir, utf8_checked, reason, old)
    finally:
        close_lock(readers)


def _rebuild(
    config: PrepareConfig, tokenizer: TokenizerBase, fmt: str, files: list[str], out_dir: Path, utf8_checked: bool,
    reason: str | None, old: dict | None,
) -> dict:  # fmt: skip
    if fmt in ("text", "json") and not utf8_checked:  # a mis-encoded input is named before anything is loaded
        for path in files:
            check_utf8(path)
    clean_stale_build_dirs(out_dir)
    build_dir = out_dir / f".prepare-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        claim_folder(build_dir, BUILD_KIND, key="data.out_dir")
    except OSError as error:
        raise storage_error(error, build_dir, "prepared data", kept="nothing was changed") from error
    try:
        t0 = time.perf_counter()
        # Stat and hash the inputs before reading them: a file edited while we work then looks
        # changed on the next run instead of silently matching stale shards.
        inputs = describe_inputs(files) if fmt != "hub" else []
        ds = load_source(fmt, files, config, cache_dir=str(build_dir / "hf-cache"), utf8_checked=True)
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
            choose_val(non_empty, config)  # raises the "cannot hold out" error before tokenizing

        dtype = token_dtype(tokenizer.vocab_size)
        column = ds.data.column(text_field)
        strip_newlines = fmt == "text" and config.sample_by == "paragraph"
        with _encoded(column, non_empty, tokenizer, config, dtype, strip_newlines) as encoded:
            splits = _write_splits(encoded, config, dtype, build_dir)
        del ds, column  # release the memory maps before the cache is deleted

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
    except (OSError, ValueError) as error:
        full = disk_failure(error)
        if full is None:
            raise
        kept = "the data there before is unchanged" if (out_dir / MANIFEST_NAME).exists() else "nothing was kept"
        raise storage_error(full, full.filename or build_dir, "prepared data", kept=kept) from error
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
