"""SHA-256 checksums of files and folders, and what differs from a manifest of them (torch-free)."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PathLike = str | os.PathLike


def sha256_file(path: PathLike, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_manifest(root: PathLike) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root`` (a folder), or {".": sha256} of ``root`` (a file): a
    manifest made before a rename still holds after it. Hashed in threads (hashlib releases the GIL)."""
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
