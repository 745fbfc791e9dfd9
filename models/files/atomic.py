"""Safe writes for everything Lantern puts on disk: write-then-rename for files and folders, destination checks,
SHA-256 manifests, one-line disk errors, and removing what killed writers left (only the standard library)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

from models.errors import LanternError

PathLike = str | os.PathLike
NATIVE_MARKER = "lantern.json"  # every native folder Lantern writes holds it
EXPORT_MARKER = ".lantern-export"  # written into the other folders Lantern writes (Hugging Face exports)
IfExists = Literal["refuse", "replace-lantern", "replace"]

log = logging.getLogger("models.files.atomic")

# errno -> what a person reads; anything else keeps the OS's own words
_STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's words for a write the disk cut short


class StorageError(LanternError, OSError):
    """A write failed because of the disk (full, read-only, no permission): one line naming the path and what was
    kept; ``errno`` is the original error's."""

    def __str__(self) -> str:
        return str(self.strerror)  # the message alone, without OSError's "[Errno N] ... : 'path'" decoration


def storage_error(error: OSError, path: PathLike, what: str, kept: str = "") -> StorageError:
    """A StorageError for ``error`` raised while writing ``what`` to ``path``."""
    code = error.errno or 0
    if not code and _SHORT_WRITE.search(str(error)):
        # numpy's tofile (the GGUF writer's tensors) reports a full disk as a short write without an errno
        code = errno.ENOSPC
    reason = _STORAGE_ERRNOS.get(code) or error.strerror or str(error)
    message = f"cannot write {what} {path}: {reason}"
    if kept:
        message += f"; {kept}"
    result = StorageError(code, message)
    result.filename = str(path)
    return result


def remove_path(path: Path) -> None:
    """Remove a file, a link or a folder tree if it is there; never raises (a leftover is harmless, an error
    on top of the one being handled is not)."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink()


def fsync_dir(path: PathLike) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories; the rename still holds
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: PathLike) -> None:
    """fsync every file under ``root`` (or ``root`` itself, a file) and every folder."""
    root = Path(root)
    if root.is_file():
        with open(root, "rb") as handle:
            os.fsync(handle.fileno())
        return
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            with open(os.path.join(dirpath, filename), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(dirpath)


# ---------------------------------------------------------------------------------------------------------
# locks held by this process, and what dead writers left

_locked_fds: set[int] = set()  # descriptors this process flock'ed (lock_exclusively); closed in forked children


def _close_locks_in_child() -> None:
    # A flock belongs to the open file description, which fork() shares with the child (O_CLOEXEC only helps across
    # exec): a worker pool forked while a lock is held would keep it after its parent is killed, and every later
    # writer would be refused on behalf of a dead process. The child closes its copies, never unlocks them (that
    # would release the parent's lock too), so a lock lives exactly as long as the process that took it.
    for fd in _locked_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _locked_fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_locks_in_child)


def lock_exclusively(fd: int, *, wait: bool = False, shared: bool = False) -> bool:
    """``flock`` the open ``fd`` for this process alone (``shared``: with other readers), never for a child it forks:
    True once held, False when another process holds it (exclusively, for a shared lock; only without ``wait``). It
    ends with ``close_lock(fd)`` or this process."""
    _locked_fds.add(fd)  # before locking: a fork in another thread right after must not keep it
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except BaseException as error:
        _locked_fds.discard(fd)
        if isinstance(error, BlockingIOError):
            return False
        raise
    return True


def close_lock(fd: int) -> None:
    """Close a descriptor ``lock_exclusively`` locked (releasing its lock); nothing if this process does not hold
    it (a forked child, whose copy is already closed)."""
    if fd in _locked_fds:
        _locked_fds.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


def hold_as_writer(path: Path, *, wait: bool = True) -> list[int]:
    """[fd] holding the lock of ``path`` (a temporary this process just made) as its live writer until close_lock,
    so that no remove_leftovers removes it; [] where it cannot be locked (then only the pid in its name does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    with contextlib.suppress(OSError):
        if lock_exclusively(fd, wait=wait):
            return [fd]
    os.close(fd)
    return []


def process_running(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive (a zombie, killed but not yet reaped, is not)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): kill said it exists
        return True


def temporary_name(target: Path, kind: Literal["tmp", "old"]) -> Path:
    """``.NAME.tmp-PID-TOKEN`` (a folder being written) or ``.NAME.old-PID-TOKEN`` (the previous one set aside)."""
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def temporary_file(target: Path) -> Path:
    """``.tmp-NAME.PID-TOKEN``: where a file replacing ``target`` is written first."""
    return target.with_name(f".tmp-{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_leftovers(target: PathLike) -> list[Path]:
    """Remove and return what Lantern writers of ``target`` that died left beside it: only Lantern's temporary names,
    only when the process named in them is not running here and nobody (another host) holds its lock."""
    target = Path(target).absolute()
    name = re.escape(target.name)
    kinds = ["tmp", "old"] if target.exists() else ["tmp"]  # without target, an old-* folder is the only copy
    pattern = re.compile(rf"(?:\.{name}\.(?:{'|'.join(kinds)})-|\.tmp-{name}\.)(\d+)-[0-9a-f]{{8}}")
    try:
        found = [(p, int(m.group(1))) for p in target.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    except OSError:
        return []
    removed = []
    for path, pid in found:
        if process_running(pid) or not _lock_is_free(path):  # the pid first: it covers a writer not yet locked
            continue
        remove_path(path)
        if not path.exists():
            log.info("removed %s: left by Lantern process %d, which died while writing %s", path, pid, target)
            removed.append(path)
    return removed


def _lock_is_free(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held by a live writer, or a file system without locks: cannot tell, so keep it
        return False
    finally:
        os.close(fd)


def rename_into_place(temporary: Path, target: Path, *, durable: bool = True) -> None:
    """Make ``temporary`` (a file, or a folder of shards) ``target`` in one rename; a folder at ``target`` is removed
    first, since no rename replaces one. ``durable`` fsyncs the data before the rename and the folder after."""
    if durable:
        fsync_tree(temporary)
    if target.is_dir() and not target.is_symlink():
        remove_path(target)
    os.replace(temporary, target)
    if durable:
        fsync_dir(target.parent)


def write_file_atomically(
    path: PathLike,
    write: Callable[[Path], object],
    *,
    what: str = "file",
    durable: bool = True,
    large: bool = False,
    previous: str = "version",
) -> Path:
    """Replace ``path`` with what ``write(temporary)`` writes, by write-then-rename: readers and a crash see the
    whole old file or the whole new one. The temporary is unique per call and removed when anything fails; an
    OSError becomes a StorageError naming ``what``. ``large``: remove what killed writers of ``path`` left and
    hold the temporary's lock while writing."""
    path = Path(path)
    if large:
        remove_leftovers(path)
    temporary = temporary_file(path)
    held: list[int] = []
    try:
        if large:
            temporary.touch(exist_ok=False)
            held = hold_as_writer(temporary)
        write(temporary)
        rename_into_place(temporary, path, durable=durable)
    except BaseException as error:
        remove_path(temporary)
        if isinstance(error, OSError) and not isinstance(error, StorageError):
            kept = f"the previous {previous} is unchanged" if path.exists() else "nothing was written"
            raise storage_error(error, path, what, kept=kept) from error
        raise
    finally:
        for fd in held:
            close_lock(fd)
    return path


def write_atomically(path: PathLike, data: str | bytes, *, what: str = "file", durable: bool = True) -> Path:
    """Replace ``path`` with ``data`` (a str as UTF-8) by write-then-rename (``write_file_atomically``).
    ``durable=False`` skips the fsyncs: a kill still leaves the whole old or new file, a machine crash may not."""
    payload = data.encode("utf-8") if isinstance(data, str) else data

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as handle:
            handle.write(payload)

    return write_file_atomically(path, write, what=what, durable=durable)


# ---------------------------------------------------------------------------------------------------------
# destinations


def written_by_lantern(directory: PathLike) -> bool:
    """True for a folder Lantern wrote: a native checkpoint (lantern.json of format "lantern") or an export
    carrying Lantern's marker."""
    directory = Path(directory)
    if (directory / EXPORT_MARKER).is_file():
        return True
    try:
        return json.loads((directory / NATIVE_MARKER).read_text()).get("format") == "lantern"
    except (OSError, ValueError, AttributeError):
        return False


def _contains(folder: Path, path: Path) -> bool:
    return path == folder or folder in path.parents


def check_destination(
    target: PathLike, *, if_exists: IfExists = "replace-lantern", sources: Iterable[PathLike] = ()
) -> None:
    """Refuse to write a folder at ``target`` when that would delete something Lantern must not delete.

    Never a folder that is, or contains, one of ``sources`` (what is being read), nor a file. An empty or
    missing folder is always fine; a non-empty one only with ``if_exists`` "replace", or "replace-lantern"
    when Lantern wrote it. Raises FileExistsError with one line that says what to do."""
    target = Path(target)
    resolved = target.resolve()
    for source in sources:
        source_path = Path(source).resolve()
        if _contains(resolved, source_path):
            raise FileExistsError(
                f"refusing to write {target}: it {'is' if resolved == source_path else 'contains'} the source "
                f"{source}; pick a destination outside it"
            )
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"refusing to write {target}: it exists and is a file, not a folder")
    entries = sorted(p.name for p in target.iterdir())
    if not entries or if_exists == "replace" or (if_exists == "replace-lantern" and written_by_lantern(target)):
        return
    listed = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    hint = (
        "pass --overwrite to replace it"
        if if_exists == "refuse"
        else "Lantern did not write it; move it away or pick another folder"
    )
    raise FileExistsError(f"refusing to replace {target}: it is not empty ({len(entries)} entries: {listed}); {hint}")


def _install_refusing(tmp: Path, target: Path, sources: Iterable[PathLike], what: str) -> None:
    """``tmp`` renamed to ``target`` in one step that fails if another writer filled ``target`` since it was checked
    (rename(2) replaces only an empty folder): of two writers racing to one destination, the second is refused as
    the check refuses a non-empty one, instead of replacing the first's folder."""
    try:
        os.rename(tmp, target)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            check_destination(target, if_exists="refuse", sources=sources)  # the usual refusal, naming the folder
        raise storage_error(error, target, what, kept="nothing was changed") from error
    fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_directory(
    target: PathLike,
    *,
    if_exists: IfExists = "replace-lantern",
    sources: Iterable[PathLike] = (),
    what: str = "checkpoint folder",
) -> Iterator[Path]:
    """Yield a hidden sibling temp dir that replaces ``target`` (checked with ``check_destination``) on success and
    is deleted on error: at every instant the complete old or the complete new folder is on disk."""
    target = Path(target).absolute()
    check_destination(target, if_exists=if_exists, sources=sources)
    remove_leftovers(target)  # what a killed writer of this destination left (hundreds of MB each)
    tmp = temporary_name(target, "tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as error:
        raise storage_error(error, target, what, kept="nothing was changed") from error
    # held until the end: while it is, nobody removes tmp (nor, below, the old folder) as a dead writer's leftover;
    # waiting only ever for a remove_leftovers elsewhere testing it this instant
    held = hold_as_writer(tmp, wait=True)
    try:
        try:
            yield tmp
            fsync_tree(tmp)
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(error, OSError) and not isinstance(error, (StorageError, FileNotFoundError)):
                kept = "the previous folder is intact" if target.exists() else "nothing was left behind"
                raise storage_error(error, target, what, kept=kept) from error
            raise
        if if_exists == "refuse":
            _install_refusing(tmp, target, sources, what)
            return
        old = None
        try:
            if target.exists():
                old = temporary_name(target, "old")
                held += hold_as_writer(target, wait=False)
                os.replace(target, old)
            os.replace(tmp, target)
        except OSError as error:
            if old is not None and old.exists():
                os.replace(old, target)
            shutil.rmtree(tmp, ignore_errors=True)
            raise storage_error(error, target, what, kept="the previous folder is intact") from error
        fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        for fd in held:
            close_lock(fd)
