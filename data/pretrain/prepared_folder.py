"""The folder ``lantern prepare`` writes: what in it Lantern wrote, and so what a rebuild may replace."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

from data.pretrain.manifest import stale_reason
from data.streams.shards import MANIFEST_NAME
from models.files.atomic import StorageError
from models.files.folders import LOCK_FILE, READERS_FILE, FolderNotLanterns, is_lanterns, listed_entries

log = logging.getLogger("lantern.prepare")

SPLITS = ("train", "val")
PREPARED_KIND = "prepared data"  # the folder marker's kind of data.out_dir
BUILD_KIND = "prepare build"  # ... and of the private build folder, so only those are ever cleaned up
SPLIT_LISTING = ".lantern-split.json"  # in each split: the files the prepare wrote there


def clean_stale_build_dirs(out_dir: Path) -> None:
    """Remove build dirs left by prepares that died: only folders a prepare made (they carry its marker; one killed
    before writing it is still empty) whose process is gone. Anything else named .prepare-* is left alone."""
    for path in out_dir.glob(".prepare-*"):
        if not path.is_dir() or not (is_lanterns(path, BUILD_KIND) or not any(path.iterdir())):
            continue
        try:
            pid = int(path.name.split("-")[1])
            os.kill(pid, 0)
            continue  # still running (another prepare): leave it alone
        except (ValueError, IndexError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        log.info("removing leftover build dir %s", path)
        shutil.rmtree(path, ignore_errors=True)


def prepared_by_lantern(out_dir: Path) -> bool:
    """A folder an older Lantern prepared (before folder markers): its manifest is Lantern's and it holds nothing
    a prepare does not write."""
    manifest = lantern_manifest(out_dir)
    return manifest is not None and all(_is_prepare_entry(p.name) for p in out_dir.iterdir())


def _is_prepare_entry(name: str) -> bool:
    return name in (MANIFEST_NAME, LOCK_FILE, READERS_FILE, *SPLITS) or name.startswith(
        (".prepare-", f".tmp-{MANIFEST_NAME}.")
    )


def lantern_manifest(out_dir: Path) -> dict | None:
    """The manifest in ``out_dir`` if Lantern wrote it (the keys only a prepare writes), else None."""
    try:
        manifest = json.loads((out_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    keys = ("version", "tokenizer", "settings", "splits")
    return manifest if isinstance(manifest, dict) and all(key in manifest for key in keys) else None


def _split_listing(split_dir: Path, manifest: dict | None) -> set[str] | None:
    """The files a prepare wrote into ``split_dir``: its own listing, else the manifest's shards (data prepared
    before listings existed); None when neither says."""
    try:
        return set(json.loads((split_dir / SPLIT_LISTING).read_text(encoding="utf-8"))["files"]) | {SPLIT_LISTING}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        shards = manifest["splits"][split_dir.name]["shards"]  # type: ignore[index]
        return {shard["file"] for shard in shards} | {"doc_offsets.npy"}
    except (KeyError, TypeError):
        return None


def check_replaceable(out_dir: Path) -> None:
    """Before a rebuild replaces ``out_dir``'s manifest and splits: each must be what a prepare wrote. A manifest
    that is not Lantern's, or a split holding a file no listing names, is refused in one line naming them."""
    manifest_path = out_dir / MANIFEST_NAME
    manifest = lantern_manifest(out_dir)
    foreign = [MANIFEST_NAME] if manifest_path.exists() and manifest is None else []
    for split in SPLITS:
        split_dir = out_dir / split
        if not split_dir.is_dir():
            foreign += [split] if split_dir.exists() else []  # a file where a split goes: never Lantern's
            continue
        listing = _split_listing(split_dir, manifest) or set()
        foreign += [f"{split}/{p.name}" for p in split_dir.iterdir() if p.name not in listing]
    if foreign:
        raise FolderNotLanterns(
            f"data.out_dir: refusing to rebuild {out_dir}: a prepare would replace what Lantern did not write there "
            f"({listed_entries(foreign)}); move them away or set data.out_dir to an empty or new folder"
        )


def check_sources_outside(out_dir: Path, files: list[str]) -> None:
    root = out_dir.resolve()
    for source in files:
        if root in Path(source).resolve().parents:
            raise FolderNotLanterns(
                f"data.out_dir {out_dir} contains the source {source}: a prepare writes and replaces what is in "
                "its folder; set data.out_dir to a folder beside the sources"
            )


def disk_failure(error: BaseException) -> OSError | None:
    """The full or read-only disk behind ``error``, if that is its cause: ``datasets`` wraps the OSError of its
    cache writes in an error about reading the input, which would blame the input."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def read_only_data(config, tokenizer, files: list[str] | None, out_dir: Path, error: OSError) -> dict:
    """A data folder this process cannot write (a shared, read-only dataset): its manifest when the data there is
    up to date, which needs no write; else one line saying it is read-only and why it would be rebuilt. ``files``:
    None for a hub dataset (whose identity only a rebuild tells)."""
    reason, old = stale_reason(config, tokenizer, files)
    if reason is None and files is not None and lantern_manifest(out_dir) is not None:
        log.info("prepared data in %s is up to date (read-only here); nothing to do", out_dir)
        return old
    why = reason or "a hub dataset is checked by rebuilding it"
    raise StorageError(
        error.errno or errno.EACCES,
        f"data folder {out_dir} is read-only here ({error.strerror or error}) and its data is not up to date "
        f"({why}): make it writable or set data.out_dir to a folder you can write",
    ) from None
