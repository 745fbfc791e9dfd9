"""Worker processes that die with the process that started them, however it dies."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

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
