"""The folders Lantern writes into: the marker naming what a folder is for (``.lantern-folder.json``), ``claim_folder``
(refuses a destination holding what Lantern did not write), one writer at a time (``lock_folder``), and no rebuild
of data a run is reading (``hold_for_reading``, ``lock_out_readers``).

The lock is ``flock``: the kernel releases it however its holder dies, and a pid written in the file is only for
the refusal's message (pids are reused and not shared across hosts). No torch: ``lantern --help`` imports this.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from models.errors import LanternError
from models.files.atomic import close_lock, lock_exclusively, process_running, write_atomically

FOLDER_MARKER = ".lantern-folder.json"
LOCK_FILE = ".lantern.lock"
READERS_FILE = ".lantern.readers"  # flock'ed shared by each run reading the folder, exclusively by a rebuild

_held_locks: dict[Path, int] = {}  # folder -> the open, flock'ed lock file of this process

if hasattr(os, "register_at_fork"):  # a forked child holds no lock: it closed its copies
    os.register_at_fork(after_in_child=_held_locks.clear)


class FolderInUse(LanternError):
    """Another live process holds the folder's lock."""


class FolderNotLanterns(LanternError, FileExistsError):
    """A destination holds files Lantern did not write, or was made by Lantern for something else."""


# ---------------------------------------------------------------------------------------------------------
# ownership


def folder_record(folder: Path) -> dict[str, Any] | None:
    """The marker Lantern wrote into ``folder`` ({"kind": ..., plus what the caller recorded}), or None."""
    try:
        record = json.loads((folder / FOLDER_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("kind"), str) else None


def listed_entries(names: Iterable[str], limit: int = 5) -> str:
    """``a, b, c, ...``: the first ``limit`` names, sorted, for a one-line error."""
    names = sorted(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def claim_folder(
    folder: str | os.PathLike,
    kind: str,
    *,
    key: str,
    record: dict[str, Any] | None = None,
    adopt: Callable[[Path], bool] | None = None,
) -> dict[str, Any]:
    """Make ``folder`` a Lantern folder of ``kind`` and return its record; refuse it when that would mix Lantern's
    files with someone else's.

    A missing or empty folder is created and marked with ``{"kind": kind, **record}``; a folder Lantern marked
    for the same kind returns the record it holds (not rewritten: the caller compares it); a folder without a
    marker for which ``adopt(folder)`` says an older Lantern wrote it is marked and taken. Anything else raises
    FolderNotLanterns naming the folder, what is in it and ``key``, the setting that chose it."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise FolderNotLanterns(f"{key}: {path} is a file, not a folder")
    found = folder_record(path) if path.is_dir() else None
    if found is not None:
        if found["kind"] != kind:
            raise FolderNotLanterns(
                f"{key}: {path} holds Lantern's {found['kind']}, not {kind}; set {key} to another folder"
            )
        return found
    # the lock, and a marker another process (a rank of the same launch) is writing right now, are Lantern's
    entries = [p.name for p in path.iterdir() if not _is_own(p.name)] if path.is_dir() else []
    if entries and not (adopt is not None and adopt(path)):
        raise FolderNotLanterns(
            f"{key}: refusing to write into {path}: it holds files Lantern did not write ({listed_entries(entries)}); "
            f"move them away or set {key} to an empty or new folder"
        )
    marker = {"kind": kind, **(record or {}), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path.mkdir(parents=True, exist_ok=True)
    write_atomically(path / FOLDER_MARKER, json.dumps(marker, indent=1) + "\n", what="folder marker")
    return marker


def _is_own(name: str) -> bool:
    return name in (LOCK_FILE, READERS_FILE) or name.startswith(
        f".tmp-{FOLDER_MARKER}."
    )  # write_atomically's temporary


def is_lanterns(folder: Path, kind: str) -> bool:
    """Whether Lantern marked ``folder`` as a ``kind`` (what may be moved aside or removed)."""
    record = folder_record(folder)
    return record is not None and record["kind"] == kind


# ---------------------------------------------------------------------------------------------------------
# one writer per folder


def lock_folder(folder: Path, *, what: str, hint: str) -> None:
    """Take ``folder``'s lock for this process, or raise FolderInUse naming the holder's process id and host,
    then ``hint`` (what to do). Idempotent within a process."""
    key = folder.resolve()
    if key in _held_locks:
        return
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        taken = lock_exclusively(fd)
    except BaseException:
        os.close(fd)
        raise
    if not taken:
        holder = _read_holder(fd)
        os.close(fd)
        raise FolderInUse(f"{what} {folder} is in use by {_describe_holder(holder, folder / LOCK_FILE)}: {hint}")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _held_locks[key] = fd


def release_folder(folder: Path) -> None:
    """Release this process's lock on ``folder`` (the file stays: deleting it would race a new locker)."""
    fd = _held_locks.pop(folder.resolve(), None)
    if fd is not None:
        close_lock(fd)


def hold_for_reading(folder: Path, *, what: str) -> int | None:
    """A shared lock on ``folder``'s readers file for as long as this process reads the folder (``close_lock`` of
    the returned descriptor ends it), so that no rebuild replaces the data under it (``lock_out_readers``); raises
    FolderInUse while a rebuild holds it. None for a read-only folder without the file: nobody rebuilds it there."""
    path = folder / READERS_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
    if not lock_exclusively(fd, shared=True):
        os.close(fd)
        rebuilder = _describe_holder(_holder_of(folder / LOCK_FILE), folder / LOCK_FILE)
        raise FolderInUse(
            f"{what} {folder} is being rebuilt by `lantern prepare` ({rebuilder}): wait for it to finish, then start again"
        )
    return fd


def lock_out_readers(folder: Path, *, what: str, hint: str) -> int:
    """The readers file of ``folder`` taken exclusively before a rebuild replaces what is there (``close_lock`` of
    the returned descriptor ends it), or FolderInUse naming the processes reading it, then ``hint``."""
    path = folder / READERS_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    if not lock_exclusively(fd):
        readers = [pid for pid in _processes_with_open(path) if pid != os.getpid()]
        os.close(fd)
        named = f"process{'es' if len(readers) > 1 else ''} {' '.join(map(str, readers))}" if readers else "a process"
        raise FolderInUse(f"{what} {folder} is being read by a training run ({named}): {hint}")
    return fd


def _holder_of(lock_file: Path) -> dict[str, str]:
    try:
        return json.loads(lock_file.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}


def _read_holder(fd: int) -> dict[str, str]:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}  # the holder has not written its name yet


def _describe_holder(holder: dict[str, Any], lock_file: Path) -> str:
    """``process PID on host HOST (since ...)``; when that process is gone from this host, the ones that still have
    the lock file open (Linux), which an older Lantern's worker processes could be."""
    pid, host, since = holder.get("pid", "?"), holder.get("host", "?"), holder.get("started", "?")
    named = f"process {pid} on host {host} (since {since})"
    if host != socket.gethostname() or not isinstance(pid, int) or process_running(pid):
        return named
    others = _processes_with_open(lock_file)
    if not others:
        return f"{named}, which has died, but a process it started still holds the lock; end that process"
    listed = " ".join(map(str, others))
    which, them = ("process", "it") if len(others) == 1 else ("processes", "them")
    return f"{which} {listed}, started by {named}, which has died; end {them} (kill {listed})"


def _processes_with_open(path: Path) -> list[int]:
    """Processes of this host with ``path`` open (Linux's /proc; [] elsewhere or where it cannot be read)."""
    try:
        wanted = os.stat(path)
        processes = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return []
    found = []
    for pid in processes:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    opened = os.stat(fd.path)
                    if (opened.st_dev, opened.st_ino) == (wanted.st_dev, wanted.st_ino):
                        found.append(int(pid))
                        break
    return sorted(found)
