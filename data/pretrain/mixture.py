"""A weighted mixture's data: each source prepared into its own folder ``out_dir/NAME`` (an ordinary prepared folder,
so a source already prepared with the same tokenizer and settings is reused, not rewritten), a small record of the
mixture (``mixture.json``), and the check training makes before compute: every source prepared, by its tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from data.pretrain.config import PrepareConfig, SourceConfig
from data.pretrain.manifest import check_manifest, write_json_atomic
from data.pretrain.prepared_folder import PREPARED_KIND
from data.pretrain.sources import resolve_inputs
from data.streams.shards import MANIFEST_NAME
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError, DataError, LanternError, one_line
from models.files.folders import claim_folder, is_lanterns, lock_folder, release_folder

log = logging.getLogger("lantern.prepare")

MIXTURE_KIND = "data mixture"  # the folder marker's kind of a mixture's data.out_dir
MIXTURE_RECORD = "mixture.json"
MIXTURE_VERSION = 1


def source_config(config: PrepareConfig, source: SourceConfig) -> PrepareConfig:
    """The one-corpus data section that prepares ``source``: data's settings, the source's overrides, its folder."""
    return dataclasses.replace(
        config,
        source=list(source.source),
        format=source.format or config.format,
        text_field=source.text_field or config.text_field,
        sample_by=source.sample_by or config.sample_by,
        out_dir=str(Path(config.out_dir) / source.name),
        sources=[],
    )


def _about_source(index: int, source: SourceConfig, error: Exception) -> Exception | None:
    """``error`` as one line that names the source (the same kind, so the CLI prints it as one line), or None."""
    text = f"data.sources[{index}] ({source.name}): {one_line(error)}"
    for kind in (ConfigError, DataError, LanternError, FileNotFoundError, OSError, ValueError):
        if isinstance(error, kind):
            return kind(text)
    return None


def prepare_data(config: PrepareConfig) -> dict[str, Any]:
    """What ``lantern prepare`` writes for a data section: one corpus (its manifest), or every source of a mixture
    (its record: per source, the splits and its manifest's digest)."""
    from data.pretrain.prepare import prepare  # deferred: the training check below needs none of it

    if not config.mixture:
        return prepare(config)
    derived = [(index, source, source_config(config, source)) for index, source in enumerate(config.sources)]
    for index, source, settings in derived:  # every source's inputs found before any is tokenized
        try:
            fmt, files = resolve_inputs(settings)
        except (OSError, ValueError) as error:
            raise _about_source(index, source, error) from error
        if fmt != "hub" and all(os.path.getsize(path) == 0 for path in files):
            raise DataError(f"data.sources[{index}] ({source.name}): no documents: {', '.join(files)} are empty")
    out_dir = Path(config.out_dir)
    claim_folder(out_dir, MIXTURE_KIND, key="data.out_dir")
    lock_folder(out_dir, what="data folder", hint="wait for it to finish, stop it, or set data.out_dir to another one")
    try:
        manifests = {}
        for index, source, settings in derived:
            try:
                manifests[source.name] = prepare(settings)
            except Exception as error:
                named = _about_source(index, source, error)
                if named is None:
                    raise
                raise named from error
        record = _record(manifests)
        if _read_json(out_dir / MIXTURE_RECORD) != record:
            write_json_atomic(out_dir / MIXTURE_RECORD, record)
        _mention_others(out_dir, list(manifests))
    finally:
        release_folder(out_dir)
    return record


def _record(manifests: dict[str, dict]) -> dict[str, Any]:
    """The mixture's record: no weights (they are training's, and may change between phases without a prepare)."""
    first = next(iter(manifests.values()))
    sources = {
        name: {
            "splits": {split: {k: info[k] for k in ("tokens", "documents")} for split, info in m["splits"].items()},
            "manifest_sha256": hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest(),
        }
        for name, m in manifests.items()
    }
    splits = {
        split: {k: sum(s["splits"][split][k] for s in sources.values()) for k in ("tokens", "documents")}
        for split in first["splits"]
    }
    return {"version": MIXTURE_VERSION, "tokenizer": first["tokenizer"], "sources": sources, "splits": splits}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _mention_others(out_dir: Path, names: list[str]) -> None:
    others = sorted(
        p.name for p in out_dir.iterdir() if p.is_dir() and p.name not in names and is_lanterns(p, PREPARED_KIND)
    )
    if others:
        log.info("%s also holds sources this config does not list: %s (left as they are)", out_dir, ", ".join(others))


def check_prepared(config: PrepareConfig, tokenizer: Tokenizer | str) -> dict[str, dict]:
    """For training, before compute: the manifest of each prepared folder by source name ("" for one corpus), after
    checking every one was prepared, by ``tokenizer``, and holds documents; one line naming the source otherwise."""
    if not config.mixture:
        return {"": check_manifest(config.out_dir, tokenizer)}
    if isinstance(tokenizer, str):
        tokenizer = Tokenizer.load(tokenizer)
    manifests = {}
    for index, source in enumerate(config.sources):
        folder = Path(config.out_dir) / source.name
        try:
            if not (folder / MANIFEST_NAME).is_file():
                raise ValueError(f"{folder} was never prepared (or its prepare was interrupted); run `lantern prepare`")
            manifest = check_manifest(folder, tokenizer)
            if not manifest["splits"]["train"]["documents"]:
                raise ValueError(f"no documents in {folder}")
        except ValueError as error:
            raise _about_source(index, source, error) from None
        manifests[source.name] = manifest
    return manifests
