"""A command stopped by SIGTERM or SIGINT exits with 128 + the signal (143, 130) and one line on stderr: what was
interrupted, the last checkpoint and how to resume; a multi-process stop ends in bounded time (``end_within``).
Only the standard library and light modules at import: ``lantern --help`` imports this module."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from trainer.checkpoints import latest_checkpoint

WATCHED = (signal.SIGTERM, signal.SIGINT)
log = logging.getLogger("lantern")


class Terminated(SystemExit):
    """SIGTERM while Lightning's own handler is not installed. A SystemExit, so that ``except Exception`` never
    swallows it, and with the exit status the signal means when nothing catches it."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


# the signal that interrupted this process, if any: signal handlers are process-wide, so is what they record
_received: int | None = None
# the timer that ends this process if a multi-process stop outlives its grace, and when it fires (time.monotonic)
_deadline: tuple[threading.Timer, float] | None = None
_deadline_lock = threading.RLock()  # re-entrant: a signal handler may arm it while the main thread holds it


def received_signal() -> int | None:
    return _received


def stop_if_received() -> None:
    """Raise Terminated if a SIGTERM came while Lightning handled it but the training it was in finished anyway (it
    only stops a loop that has steps left): whatever comes next (the next pipeline stage) must not start."""
    if _received == signal.SIGTERM:
        raise Terminated(_received)


def _handle(signum: int, frame: FrameType | None) -> None:
    global _received
    first = _received is None
    _received = _received or signum  # the first signal names the interruption
    if signum == signal.SIGINT:
        raise KeyboardInterrupt  # Python's own Ctrl-C; inside trainer.fit Lightning turns it into a graceful stop
    if first and signal.getsignal(signal.SIGTERM) is _handle:
        raise Terminated(signum)
    # else Lightning's handler called this one after setting trainer.received_sigterm: its loop stops at the end of
    # the batch under way; or a second SIGTERM came while the first one's stop runs its cleanup: let it finish


@contextlib.contextmanager
def watch_signals() -> Iterator[None]:
    """Record SIGTERM and SIGINT (see the module docstring) while the block runs; the previous handlers come back
    after it. A signal the process was started ignoring (``nohup``, ``cmd &``) stays ignored."""
    global _received
    _received = None
    if threading.current_thread() is not threading.main_thread():  # handlers can only be installed from there
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in WATCHED}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, _handle)
    try:
        yield
    finally:
        # Lightning leaves SIGINT ignored after a Ctrl-C (its graceful shutdown): restore what the caller had
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        _received = None  # a later command in this process (tests) starts uninterrupted
        _cancel_deadline()


def say_if_sigint_ignored() -> None:
    """At the start of training: a process started with SIGINT ignored (a shell's `cmd &` without job control,
    nohup) keeps it so, by POSIX's convention, which Python and the shell keep: whoever started it chose that a
    Ctrl-C meant for something else spares it. Said once, with what does stop the run the same way."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        log.info(
            "SIGINT (Ctrl-C, kill -INT) is ignored: this process was started with it ignored (nohup, or `&` in a "
            "script) and keeps it so; stop it with SIGTERM (kill %d), which saves a checkpoint and exits 143",
            os.getpid(),
        )


def note_signal(signum: int) -> None:
    """Record ``signum`` as this process's interruption though another rank received it (the ranks agreed to stop
    on it): the command then ends as if it had received it itself (exit 128 + signum)."""
    global _received
    _received = _received or signum


def end_within(seconds: float, last_words: Callable[[], str]) -> None:
    """Arm, once, a timer that ends this process ``seconds`` from now if it is still running then: ``last_words``
    runs (ending child processes, and the line to print, if any, which goes straight to stderr) and the process
    exits at once with 128 + the signal, finally blocks or not: a stop that cannot finish in time (a rank hung in a
    collective) ends without saving rather than not at all."""
    global _deadline
    with _deadline_lock:
        if _deadline is not None:
            return
        timer = threading.Timer(seconds, _expire, (last_words,))
        timer.daemon = True
        _deadline = (timer, time.monotonic() + seconds)
    timer.start()


def deadline() -> float | None:
    """When the timer ``end_within`` armed fires (``time.monotonic``), if one is armed."""
    armed = _deadline
    return armed[1] if armed else None


def _expire(last_words: Callable[[], str]) -> None:
    try:
        line = last_words()
        if line:  # not through logging: the main thread may hold its lock, stuck where it waits
            os.write(2, (line.replace("\n", " ") + "\n").encode())
    finally:
        os._exit(128 + (_received or signal.SIGTERM))


def _cancel_deadline() -> None:
    global _deadline
    with _deadline_lock:
        if _deadline is not None:
            _deadline[0].cancel()
        _deadline = None


def end_children(children: list[subprocess.Popen], *, until: float, signum: int | None = None) -> None:
    """Send ``signum`` (if given) to ``children``, wait for them until ``until`` (``time.monotonic``), then SIGKILL
    and reap what is left: a main process never exits leaving ranks behind, stuck in a collective with it."""
    for child in children:
        if signum is not None:
            child.send_signal(signum)  # a no-op for one that has exited
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=max(until - time.monotonic(), 0.0))
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()


def watch_delivery(seconds: float, last_words: Callable[[], str]) -> Callable[[], None]:
    """Call ``end_within(seconds, last_words)`` the moment a SIGTERM is delivered: Python runs its handlers only
    when the main thread is back in Python, never while it waits in a collective for a rank that will not come,
    but it writes each signal's number to the wakeup fd at once, and a thread reads it there. Returns the function
    that stops watching (main thread only, as is this one; a no-op elsewhere, and on other systems than POSIX)."""
    if threading.current_thread() is not threading.main_thread() or os.name != "posix":
        return lambda: None
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    previous = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)

    def watch() -> None:
        while data := os.read(reader, 64):  # b"" once the writer is closed: watching stopped
            if previous != -1:  # whoever set the wakeup fd before (an event loop) still hears of every signal
                with contextlib.suppress(OSError):
                    os.write(previous, data)
            if signal.SIGTERM in data:
                end_within(seconds, last_words)
        os.close(reader)

    threading.Thread(target=watch, name="lantern-sigterm-deadline", daemon=True).start()

    stopped = threading.Event()

    def stop() -> None:
        if not stopped.is_set():
            stopped.set()
            signal.set_wakeup_fd(previous)
            os.close(writer)

    return stop


def checkpoint_note(checkpoints: Path) -> str:
    found = latest_checkpoint(checkpoints, verified=False)  # hashing gigabytes is not for the moment of a Ctrl-C
    return f"the last checkpoint is {found}" if found else f"no checkpoint in {checkpoints} yet"


def _stage_note(schema: tuple[str, str], prefix: str, config_path: str, overrides: list[str]) -> str:
    """Where an interrupted training command's checkpoints are and whether the same command resumes from them;
    ``schema`` names its config's class (module, name), imported only now; ``prefix`` is where in it the
    checkpoint section is ("sft." for rejection sampling)."""
    module, name = schema
    from trainer.config import load_config  # deferred: only an interrupted training command needs it

    config: Any = load_config(getattr(importlib.import_module(module), name), config_path, overrides)
    section = functools.reduce(getattr, prefix.split(".")[:-1], config)
    checkpoints = Path(config.run.out_dir) / config.run.name / "checkpoints"
    if latest_checkpoint(checkpoints, verified=False) is None:
        return f"{checkpoint_note(checkpoints)}: running the same command again starts it over"
    if section.checkpoint.resume != "auto":  # none or a given PATH: the same command would not resume from it
        return f"{checkpoint_note(checkpoints)}: run it again with {prefix}checkpoint.resume=auto to resume from it"
    return f"{checkpoint_note(checkpoints)}: run the same command again to resume from it"


def interrupted_message(
    command: str,
    signum: int,
    error: BaseException,
    args: Any,
    schema: tuple[str, str] | None = None,
    training_prefix: str = "",
) -> str:
    """The one line an interrupted command prints: the signal, what the code that was stopped added to the error
    (``add_note``: the pipeline's stage and command) and, for a training command (``schema``: its config class as
    (module, name), and ``training_prefix``, where its checkpoint section is: the CLI knows both), its checkpoint
    and resume; "" on the ranks other than 0 of a
    multi-process run."""
    # Every rank stops; rank 0 says so, once. Other ranks exist only once Lightning (imported with trainer.storage)
    # launched them, and importing it now could fail: the signal may have stopped `import torch` half-way.
    storage = sys.modules.get("trainer.storage")
    if storage is not None and not storage.is_global_rank_zero():
        return ""
    notes = list(getattr(error, "__notes__", []))
    if schema is not None and not notes:
        # a broken config, or an import the signal cut short: the interruption is still the news
        with contextlib.suppress(Exception):
            notes.append(_stage_note(schema, training_prefix, args.config, args.overrides))
    if isinstance(error, Exception):  # something failed on the way out: say so, it may matter
        notes.append(f"it stopped with {type(error).__name__}: {str(error).strip()[:200]}")
    name = signal.Signals(signum).name
    return "; ".join([f"lantern {command}: interrupted by {name}", *notes]).replace("\n", " ")


def resume_command(*words: str) -> str:
    return shlex.join(["lantern", *words])
