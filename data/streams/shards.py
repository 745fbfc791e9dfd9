"""Prepared token shards as they are read: the folder's manifest (``read_manifest``) and one split's shards as one
memory-mapped token stream (``TokenStream``). Light: numpy only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MANIFEST_NAME = "manifest.json"  # written last by ``lantern prepare``: its presence means the data is complete


def read_manifest(data_dir: str | Path) -> dict:
    """The manifest of a prepared data dir; ValueError if there is none (never prepared, or interrupted)."""
    path = Path(data_dir) / MANIFEST_NAME
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"no {MANIFEST_NAME} in {data_dir}: the data was never prepared there or the preparation was "
            "interrupted; run `lantern prepare` first"
        ) from None


class TokenStream:
    """Memory-mapped view of a split's shard files as one token stream.

    The shards are opened lazily, so a TokenStream is cheap to pickle into DataLoader workers
    (each worker maps the files itself instead of receiving copies of the data)."""

    def __init__(self, split_dir: str | Path):
        self.split_dir = Path(split_dir)
        self.split = self.split_dir.name
        manifest = read_manifest(self.split_dir.parent)
        if self.split not in manifest["splits"]:
            raise ValueError(f"{self.split_dir.parent} has no split {self.split!r}; it has {list(manifest['splits'])}")
        info = manifest["splits"][self.split]
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.vocab_size: int = manifest["tokenizer"]["vocab_size"]
        self._files = [self.split_dir / shard["file"] for shard in info["shards"]]
        sizes = [shard["tokens"] for shard in info["shards"]]
        for path, tokens in zip(self._files, sizes):
            actual = path.stat().st_size if path.is_file() else None
            if actual != tokens * self.dtype.itemsize:
                raise ValueError(
                    f"shard {path} is missing or truncated ({actual} bytes, expected {tokens * self.dtype.itemsize}); "
                    "re-run `lantern prepare`"
                )
        # starts[k] = stream offset of shard k's first token; starts[-1] = total tokens.
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.doc_offsets: np.ndarray = np.load(self.split_dir / "doc_offsets.npy", mmap_mode="r")
        if self.doc_offsets[-1] != self.starts[-1]:
            raise ValueError(
                f"{self.split_dir}/doc_offsets.npy ends at {self.doc_offsets[-1]} but the shards hold "
                f"{self.starts[-1]} tokens; re-run `lantern prepare`"
            )
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1

    def _shards(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [np.memmap(path, dtype=self.dtype, mode="r") for path in self._files]
        return self._maps

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = None  # re-mapped on first read in the receiving process
        return state

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as a new array (crossing shard boundaries as needed)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"read({start}, {stop}) out of range for a stream of {len(self)} tokens")
        shards = self._shards()
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        k, pos = first, start
        while pos < stop:
            lo = pos - self.starts[k]
            hi = min(stop, self.starts[k + 1]) - self.starts[k]
            parts.append(shards[k][lo:hi])
            pos = int(self.starts[k] + hi)
            k += 1
        if not parts:
            return np.empty(0, dtype=self.dtype)
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])

    def document_index(self, positions: np.ndarray) -> np.ndarray:
        """Index of the document each stream position belongs to."""
        return np.searchsorted(self.doc_offsets, positions, side="right") - 1
