"""data/pretrain/batches.py: a text column cut into row ranges of about a size, and a function over them run on
threads or forked processes with the results in order (on threads, each batch finished by the reader)."""

from __future__ import annotations

import os
import threading

import pyarrow as pa
import pytest

from data.pretrain.batches import mapped_in_order, row_batches


def column(texts: list[str]) -> pa.ChunkedArray:
    half = len(texts) // 2
    return pa.chunked_array([pa.array(texts[:half], pa.string()), pa.array(texts[half:], pa.string())])


def test_row_batches_cover_every_row_once_in_order_at_about_the_size():
    texts = [f"document {i} " * (1 + i % 7) for i in range(1000)]
    batches = row_batches(column(texts), batch_bytes=2000)
    assert batches[0][0] == 0 and batches[-1][1] == len(texts)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(batches, batches[1:]))
    sizes = [sum(len(t) for t in texts[a:b]) for a, b in batches]
    assert len(batches) == sum(map(len, texts)) // 2000 + 1 and max(sizes) < 2 * 2000


@pytest.mark.parametrize(("texts", "at_least", "count"), [
    (["a", "b", "c"], 2, 2),  # small: one batch per worker all the same
    (["a"], 4, 1),  # never more batches than rows
    (["x" * 10_000, "a", "b", "c"], 3, 3),  # one row holds most of the bytes: cut by rows instead
    ([], 2, 0),
])  # fmt: skip
def test_row_batches_give_each_worker_one_when_there_are_rows_enough(texts, at_least, count):
    batches = row_batches(column(texts), batch_bytes=1 << 20, at_least=at_least)
    assert len(batches) == count
    assert [r for a, b in batches for r in range(a, b)] == list(range(len(texts)))


def shout(texts: list[str]):
    """Started in a worker: its process and thread; finished where the result is made."""
    started = (os.getpid(), threading.get_ident())
    return lambda: (started, (os.getpid(), threading.get_ident()), [t.upper() for t in texts])


@pytest.mark.parametrize("processes", [False, True])
def test_results_come_in_batch_order_from_threads_or_forked_processes(processes):
    texts = [f"t{i}" for i in range(50)]
    batches = row_batches(column(texts), batch_bytes=16)
    with mapped_in_order(shout, column(texts), batches, workers=2, processes=processes) as results:
        got = list(results)
    assert [t for _, _, part in got for t in part] == [t.upper() for t in texts]
    here = (os.getpid(), threading.get_ident())
    if processes:  # started and finished in a worker process
        assert all(started == finished and started[0] != here[0] for started, finished, _ in got)
    else:  # started on a worker thread, finished on the reader's
        assert all(started[0] == here[0] and started[1] != here[1] and finished == here for started, finished, _ in got)


def fail_on_seven(texts: list[str]):
    if "t7" in texts:
        raise ValueError("bad batch")
    return lambda: texts


@pytest.mark.parametrize("processes", [False, True])
def test_a_worker_error_reaches_the_reader(processes):
    texts = [f"t{i}" for i in range(20)]
    batches = row_batches(column(texts), batch_bytes=8)
    mapped = mapped_in_order(fail_on_seven, column(texts), batches, workers=2, processes=processes)
    with pytest.raises(ValueError, match="bad batch"), mapped as results:
        list(results)
