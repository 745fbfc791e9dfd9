"""The manifest of a prepared data folder as ``lantern prepare`` writes it: checked against a tokenizer, the inputs'
fingerprints, and why a folder is stale (only settings that change the bytes written count)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from data.pretrain.config import PrepareConfig
from data.streams.shards import MANIFEST_NAME, read_manifest
from data.tokenizer.tokenizer import Tokenizer
from models.files.atomic import write_atomically

# Bump when the on-disk layout changes: older data is then rebuilt rather than misread.
MANIFEST_VERSION = 1
# Settings that do not change the bytes written: changing them must not trigger a rebuild.
# (The tokenizer is compared by fingerprint, so "default" and its file path count as the same; ``sources`` is a
# mixture's list, empty in each source's own folder and absent from manifests written before mixtures.)
_NON_DATA_SETTINGS = {"num_proc", "out_dir", "tokenizer", "source", "sources"}


def check_manifest(data_dir: str | Path, tokenizer: Tokenizer | str) -> dict:
    """For training code: the manifest of `data_dir`, after checking the data was tokenized by `tokenizer`
    (a Tokenizer or a spec for Tokenizer.load). Token ids from another tokenizer would silently train garbage."""
    manifest = read_manifest(data_dir)
    if isinstance(tokenizer, str):
        tokenizer = Tokenizer.load(tokenizer)
    prepared = manifest["tokenizer"]
    if prepared["fingerprint"] != tokenizer.fingerprint:
        raise ValueError(
            f"the data in {data_dir} was tokenized by {prepared['spec']!r} (fingerprint {prepared['fingerprint']}) "
            f"but training uses {tokenizer.path!r} (fingerprint {tokenizer.fingerprint}); "
            "re-run `lantern prepare` with this tokenizer, or train with the one the data was prepared with"
        )
    return manifest


def data_fingerprint(manifest: dict) -> str:
    """What a prepared folder holds, as one hash: its inputs (paths, sizes and sha256), tokenizer, the settings that
    change the bytes written, and each split's token and document counts. The same for a rebuild of the same inputs;
    another for data prepared from another corpus, even of the same size."""
    settings = {k: v for k, v in (manifest.get("settings") or {}).items() if k not in _NON_DATA_SETTINGS}
    identity = {
        "inputs": manifest.get("inputs"),
        "tokenizer": (manifest.get("tokenizer") or {}).get("fingerprint"),
        "settings": settings,
        "splits": {name: [s.get("tokens"), s.get("documents")] for name, s in (manifest.get("splits") or {}).items()},
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json_atomic(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON, replacing ``path`` atomically."""
    write_atomically(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n", what="data manifest")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def describe_inputs(files: list[str], with_hash: bool = True) -> list[dict]:
    inputs = []
    for path in files:
        st = os.stat(path)
        entry = {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if with_hash:
            entry["sha256"] = _sha256(path)
        inputs.append(entry)
    return inputs


# -----------------------------------------------------------------------------
# staleness


def _data_settings(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in _NON_DATA_SETTINGS}


def _inputs_changed(old: list[dict], files: list[str]) -> tuple[str | None, bool]:
    """(reason the inputs differ or None, whether only mtimes moved). A file whose size matches but
    whose mtime moved (a checkout, a copy) is hashed: same content counts as unchanged."""
    old_paths = [entry["path"] for entry in old]
    if old_paths != files:
        added = [p for p in files if p not in old_paths]
        removed = [p for p in old_paths if p not in files]
        parts = [f"added {added}" if added else "", f"removed {removed}" if removed else ""]
        return "inputs changed: " + (", ".join(p for p in parts if p) or "file order differs"), False
    touched = False
    for entry in old:
        st = os.stat(entry["path"])
        if st.st_size != entry["size"]:
            return f"input changed: {entry['path']} (size {entry['size']} → {st.st_size})", False
        if st.st_mtime_ns != entry.get("mtime_ns"):
            if entry.get("sha256") != _sha256(entry["path"]):
                return f"input changed: {entry['path']} (content differs)", False
            touched = True
    return None, touched


def _split_files_ok(out_dir: Path, manifest: dict) -> str | None:
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            path = out_dir / split / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * itemsize:
                return f"shard {path} is missing or has the wrong size"
        if not (out_dir / split / "doc_offsets.npy").is_file():
            return f"{out_dir / split / 'doc_offsets.npy'} is missing"
    return None


def stale_reason(
    config: PrepareConfig, tokenizer: Tokenizer, files: list[str] | None
) -> tuple[str | None, dict | None]:
    """(why `out_dir` must be rebuilt or None, the existing manifest). files=None for hub inputs,
    whose identity is checked separately (it needs the dataset loaded)."""
    out_dir = Path(config.out_dir)
    try:
        old = read_manifest(out_dir)
    except json.JSONDecodeError:  # (a ValueError too: catch it first)
        return f"{out_dir / MANIFEST_NAME} is unreadable", None
    except ValueError:
        return f"no complete prepared data in {out_dir}", None
    if old.get("version") != MANIFEST_VERSION:
        return f"data layout version changed: {old.get('version')} → {MANIFEST_VERSION}", old
    old_tok = old["tokenizer"]
    if old_tok["fingerprint"] != tokenizer.fingerprint:
        return (
            f"tokenizer changed: {old_tok['spec']} ({old_tok['fingerprint'][:12]}) → "
            f"{config.tokenizer} ({tokenizer.fingerprint[:12]})"
        ), old
    old_settings = _data_settings(old["settings"])
    new_settings = _data_settings(dataclasses.asdict(config))
    if old_settings != new_settings:
        diffs = [
            f"{k}: {old_settings.get(k)!r} → {new_settings.get(k)!r}"
            for k in sorted(set(old_settings) | set(new_settings))
            if old_settings.get(k) != new_settings.get(k)
        ]
        return "settings changed: " + ", ".join(diffs), old
    if files is not None:
        reason, touched = _inputs_changed(old["inputs"], files)
        if reason:
            return reason, old
        if touched:  # same content, new mtimes: refresh them so the next check is cheap again
            old["inputs"] = [{**entry, "mtime_ns": os.stat(entry["path"]).st_mtime_ns} for entry in old["inputs"]]
            write_json_atomic(out_dir / MANIFEST_NAME, old)
    return _split_files_ok(out_dir, old), old
