"""Running one function over a text column's batches on worker threads or forked processes, results in order."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import signal
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import numpy as np

Rows = tuple[int, int]  # [start, stop) of a column's rows

# What the forked workers run: set before they are forked, inherited with the process, so neither the column nor
# the tokenizer is ever pickled (only each batch's row range goes to a worker, only its result comes back).
_JOB: tuple[Callable[[list[str]], Callable[[], Any]], Any] | None = None


def row_batches(column, batch_bytes: int, at_least: int = 1) -> list[Rows]:
    """Consecutive row ranges of about ``batch_bytes`` of text each, and at least ``at_least`` of them (one per
    worker) when there are that many rows. ``column``: a pyarrow (chunked) string array."""
    import pyarrow.compute as pc  # deferred: heavy, and only needed when there is work

    rows = len(column)
    if rows == 0:
        return []
    sizes = pc.binary_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(sizes)
    count = max(int(ends[-1]) // batch_bytes + 1, min(at_least, rows))
    # a cut after the row where each equal share of the bytes ends; one row may hold more than a share
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, count) / count, side="left") + 1
    bounds = np.unique(np.concatenate([[0], np.minimum(cuts, rows), [rows]]))
    if len(bounds) - 1 < min(at_least, rows):  # a few huge rows took the shares: split by rows instead
        bounds = np.unique(np.linspace(0, rows, min(at_least, rows) + 1).astype(np.int64))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _start(rows: Rows, job: tuple[Callable[[list[str]], Callable[[], Any]], Any]) -> Callable[[], Any]:
    function, column = job
    start, stop = rows
    return function(column.slice(start, stop - start).to_pylist())


def _run(rows: Rows) -> Any:
    # in a forked worker: the whole batch, so that only its result travels back
    assert _JOB is not None, "forked before the job was set"
    return _start(rows, _JOB)()


def _ignore_interrupts() -> None:
    # Ctrl-C reaches the whole process group: the parent handles it (and stops the pool), not each worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def mapped_in_order(
    function: Callable[[list[str]], Callable[[], Any]], column, batches: list[Rows], workers: int, processes: bool
) -> Iterator[Iterator[Any]]:
    """For each batch in order, ``function(texts)()``: ``function`` starts the batch's work and returns what
    finishes it. On threads (an encoder that releases the GIL, or has its own thread pool), the reader finishes
    each batch while the workers start the next ones; on processes forked from this one (an encoder whose Python
    side would serialise threads on the GIL), a worker does both. Leaving the block stops the workers."""
    global _JOB
    executor: Executor
    if processes:
        _JOB = (function, column)
        context = multiprocessing.get_context("fork")  # the workers inherit _JOB; nothing is pickled but rows
        executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_ignore_interrupts)
        submit = lambda rows: executor.submit(_run, rows)  # noqa: E731
        finish = lambda result: result  # noqa: E731
    else:
        executor = ThreadPoolExecutor(workers, thread_name_prefix="lantern-prepare")
        submit = lambda rows: executor.submit(_start, rows, (function, column))  # noqa: E731
        finish = lambda started: started()  # noqa: E731
    try:
        upcoming = iter(batches)
        # the first batches start now, while the caller still prepares (counts the documents)
        pending = deque(submit(rows) for rows in itertools.islice(upcoming, workers))

        def results() -> Iterator[Any]:
            while pending:
                pending.extend(submit(rows) for rows in itertools.islice(upcoming, 1))  # one queued behind them
                yield finish(pending.popleft().result())

        yield results()
    finally:
        # cancel what has not started; a running batch finishes first (a worker ignores Ctrl-C)
        executor.shutdown(wait=True, cancel_futures=True)
        _JOB = None
