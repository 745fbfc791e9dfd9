"""Safe writes, shared by everything Lantern puts on disk: files replaced by write-then-rename, folders built
beside their destination and renamed into place, destination checks that never let Lantern delete what it
did not write, SHA-256 manifests, and one-line errors for a full or read-only disk.

The lowest layer (no torch, no Lightning): models/checkpoint.py, the trainer's checkpoints, metrics and
plots all write through these helpers.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from models.errors import LanternError

PathLike = str | os.PathLike
NATIVE_MARKER = "lantern.json"  # every native folder Lantern writes holds it
EXPORT_MARKER = ".lantern-export"  # written into the other folders Lantern writes (Hugging Face exports)
IfExists = Literal["refuse", "replace-lantern", "replace"]

# errno -> what a person reads; anything else keeps the OS's own words
_STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


class StorageError(LanternError, OSError):
    """A write failed because of the disk (full, read-only, no permission). The message is one line that
    names the path and says what was kept; ``errno`` is the original error's."""

    def __str__(self) -> str:
        return str(self.strerror)  # the message alone, without OSError's "[Errno N] ... : 'path'" decoration


def storage_error(error: OSError, path: PathLike, what: str, kept: str = "") -> StorageError:
    """A StorageError for ``error`` raised while writing ``what`` to ``path``."""
    reason = _STORAGE_ERRNOS.get(error.errno or 0) or error.strerror or str(error)
    message = f"cannot write {what} {path}: {reason}"
    if kept:
        message += f"; {kept}"
    result = StorageError(error.errno or 0, message)
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


def write_atomically(path: PathLike, data: str | bytes, *, what: str = "file", durable: bool = True) -> Path:
    """Replace ``path`` with ``data`` by write-then-rename: readers and a crash (kill -9, full disk) see the
    whole old file or the whole new one, never a truncated one. The temporary is unique per call, so two
    writers never collide on it, and removed when the write fails (raised as a StorageError). ``durable=False``
    skips the fsyncs, for a record rewritten at every logged step whose version one step stale after a machine
    crash costs little (trainer/wandb_run.py); a kill -9 still leaves the whole old or new file."""
    path = Path(path)
    temporary = path.with_name(f".tmp-{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    payload = data.encode("utf-8") if isinstance(data, str) else data  # UTF-8 whatever the locale
    try:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        remove_path(temporary)
        kept = "the previous version is unchanged" if path.exists() else "nothing was written"
        raise storage_error(error, path, what, kept=kept) from error
    if durable:
        fsync_dir(path.parent)
    return path


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


@contextlib.contextmanager
def atomic_directory(
    target: PathLike,
    *,
    if_exists: IfExists = "replace-lantern",
    sources: Iterable[PathLike] = (),
    what: str = "checkpoint folder",
) -> Iterator[Path]:
    """Yield a hidden sibling temp dir; on success it replaces ``target``, on error it is deleted.

    ``target`` is first checked with ``check_destination``. The old folder is renamed aside
    (``.NAME.old-*``) before the new one is renamed in and deleted only after, so at every instant either
    the complete old or the complete new folder is on disk. A full or read-only disk is a StorageError.
    """
    target = Path(target).absolute()
    check_destination(target, if_exists=if_exists, sources=sources)
    token = uuid.uuid4().hex[:8]
    tmp = target.parent / f".{target.name}.tmp-{token}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as error:
        raise storage_error(error, target, what, kept="nothing was changed") from error
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, OSError) and not isinstance(error, (StorageError, FileNotFoundError)):
            kept = "the previous folder is intact" if target.exists() else "nothing was left behind"
            raise storage_error(error, target, what, kept=kept) from error
        raise
    old = None
    try:
        if target.exists():
            old = target.parent / f".{target.name}.old-{token}"
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


# ---------------------------------------------------------------------------------------------------------
# checksums


def sha256_file(path: PathLike, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_manifest(root: PathLike) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root`` (a folder), or {".": sha256} of ``root`` (a file),
    so a manifest made before a rename still holds after it. Files are hashed in parallel threads (hashlib
    releases the GIL), for sharded checkpoints."""
    root = Path(root)
    if root.is_file():
        return {".": sha256_file(root)}
    files = sorted(p for p in root.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        digests = list(pool.map(sha256_file, files))
    return {str(p.relative_to(root)): digest for p, digest in zip(files, digests)}


def manifest_mismatch(root: PathLike, expected: dict[str, str]) -> str | None:
    """None when ``root`` holds exactly the files of ``expected`` with those hashes; else what differs."""
    root = Path(root)
    if not root.exists():
        return "missing"
    try:
        actual = sha256_manifest(root)
    except OSError as error:
        return f"unreadable ({error})"
    missing = sorted(set(expected) - set(actual))
    if missing:
        return f"files missing: {missing[:3]}"
    changed = sorted(name for name in expected if actual[name] != expected[name])
    if changed:
        return f"checksum mismatch in {changed[:3]} (truncated or corrupted)"
    return None
