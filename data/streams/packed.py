"""Packed pretraining windows over prepared token shards (``PackedDataset``), and the seeded, resumable global order
of samples every datamodule draws from (``StreamSampler``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from data.streams.shards import TokenStream
from models.loss import IGNORE_INDEX  # F.cross_entropy's default ignore_index

log = logging.getLogger("lantern.data")


class PackedDataset(Dataset):
    """Sample i = tokens [i*seq_len, i*seq_len + seq_len + 1): inputs are the first seq_len tokens,
    targets the last seq_len (shifted by one). Windows do not overlap except for that one token,
    so one pass over the samples sees every token once as an input."""

    def __init__(self, split_dir: str | Path, seq_len: int, document_masking: bool = True):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.stream = TokenStream(split_dir)
        self.seq_len = seq_len
        self.document_masking = document_masking
        n_tokens = len(self.stream)
        if n_tokens < seq_len + 1:
            raise ValueError(
                f"split {self.stream.split!r} in {self.stream.split_dir.parent} has {n_tokens} tokens, fewer than "
                f"one sequence of seq_len+1={seq_len + 1}; lower loader.seq_len or add data"
            )
        self.num_samples = (n_tokens - 1) // seq_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        start = index * self.seq_len
        window = torch.from_numpy(self.stream.read(start, start + self.seq_len + 1).astype(np.int64))
        sample = {"input_ids": window[:-1], "targets": window[1:].clone()}
        if self.document_masking:
            docs = self.stream.document_index(np.arange(start, start + self.seq_len + 1))
            docs = torch.from_numpy(docs - docs[0])  # window-local: 0 for the first document in view
            # The token after a document's last token starts another document the model cannot see
            # (it is masked out of attention): predicting it would only teach noise.
            sample["targets"][docs[1:] != docs[:-1]] = IGNORE_INDEX
            sample["document_ids"] = docs[:-1].contiguous()
        return sample


class GlobalStream(Sampler[int]):
    """The position bookkeeping of ONE infinite global stream of sample indices shared by all ranks: rank r of W
    reads positions consumed + r, consumed + r + W, ...; a subclass maps a position to an index (``index_at``) and
    says how many positions are one pass per rank (``__len__``).

    Iterating does not move `consumed` (loaders prefetch ahead of training); the training loop reports
    what it actually trained on with advance(). len() is one pass's worth per rank, which is what
    Lightning calls an epoch; the next iter() simply continues the stream.
    """

    def __init__(self, *, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world_size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.consumed = 0
        self._last_iter_start: int | None = None

    def index_at(self, position: int) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        start = self.consumed  # fixed now, not at the first next(): the generator body runs lazily
        if start == self._last_iter_start:
            log.warning(
                "%s: a new pass starts at the same stream position %d as the previous one; report consumed samples "
                "(the datamodule's mark_consumed) or every epoch repeats the same data",
                type(self).__name__,
                start,
            )
        self._last_iter_start = start
        return (self.index_at(start + self.rank + k * self.world_size) for k in range(len(self)))

    def advance(self, global_samples: int) -> None:
        """Mark `global_samples` more positions (summed over all ranks) as trained on."""
        if global_samples < 0:
            raise ValueError(f"cannot advance by {global_samples}")
        self.consumed += int(global_samples)


class StreamSampler(GlobalStream):
    """Sample indices of one corpus as a ``GlobalStream``.

    Global position g maps to epoch e = g // num_samples and sample perm_e[g % num_samples], where
    perm_e is a permutation seeded by (seed, e) (the identity without shuffle). Rank r of W reads
    positions consumed + r, consumed + r + W, ... . Because the order depends only on the global
    position, resuming from `consumed` continues with exactly the next samples on any world size.
    """

    def __init__(self, num_samples: int, *, rank: int = 0, world_size: int = 1, shuffle: bool = True, seed: int = 0):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        super().__init__(rank=rank, world_size=world_size)
        if num_samples < world_size:
            raise ValueError(f"{num_samples} samples cannot be shared by {world_size} ranks; add data or lower seq_len")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def _perm(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache = (epoch, rng.permutation(self.num_samples))
        return self._perm_cache[1]

    def index_at(self, position: int) -> int:
        """Sample index at global stream position `position`."""
        epoch, offset = divmod(position, self.num_samples)
        return int(self._perm(epoch)[offset]) if self.shuffle else offset

    def __len__(self) -> int:
        return self.num_samples // self.world_size

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if "sources" in state:  # a MixtureSampler's
            raise ValueError(
                f"cannot resume the data stream: the checkpoint trained on a mixture of {', '.join(state['sources'])} "
                "(data.sources), this config reads one corpus (data.source); keep the mixture, or start a new run"
            )
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"cannot resume the data stream: the checkpoint was taken with {state['num_samples']} samples per "
                f"epoch, now there are {self.num_samples} (the prepared data or seq_len changed)"
            )
        self.consumed = int(state["consumed"])
        self.seed = int(state["seed"])
        self._perm_cache = None
        self._last_iter_start = None
