"""A weighted mixture of sources as ONE resumable global stream (``MixtureSampler``): which source each global
position draws from, and which of that source's windows.

Megatron's blend gives each sample to the source furthest behind its share; here the same low-discrepancy order is
laid out once for a period of ``PERIOD`` positions (each source's k-th window of the period at its ideal time
(k + 1/2) / count, all merged by time) and repeated, so any position maps to its source in O(1): a resume on any
world size needs no replay, and each source's share of any run of n positions is within a few windows of n x weight.
Numpy only."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping

import numpy as np

from data.streams.datamodule import GlobalStream

log = logging.getLogger("lantern.data")

PERIOD = 2**16  # positions of one period of the interleave: shares are exact to 1 / PERIOD


def normalised(weights: Mapping[str, float]) -> dict[str, float]:
    """Weights as shares summing to 1 (the config refused weights <= 0, NaN and infinities at load)."""
    total = float(sum(weights.values()))
    return {name: float(weight) / total for name, weight in weights.items()}


def period_counts(shares: np.ndarray, period: int = PERIOD) -> np.ndarray:
    """Windows per source in one period: the largest-remainder rounding of shares x period, at least 1 each."""
    ideal = shares * period
    counts = np.floor(ideal).astype(np.int64)
    counts[np.argsort(-(ideal - counts), kind="stable")[: period - counts.sum()]] += 1
    while (counts == 0).any():  # a share under 1 / period still draws: from the largest source
        counts[np.argmax(counts)] -= 1
        counts[np.argmin(counts)] += 1
    return counts


def interleave(shares: np.ndarray, period: int = PERIOD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the source at each offset of a period, the window of the period it is for that source, windows per source
    per period)."""
    counts = period_counts(shares, period)
    owner = np.repeat(np.arange(len(counts)), counts)
    occurrence = np.concatenate([np.arange(count) for count in counts])
    times = (occurrence + 0.5) / counts[owner]
    order = np.lexsort((owner, times))  # by ideal time, ties by source order
    return owner[order], occurrence[order], counts


def drawn_before(
    position: int, phase_start: int, phase_counts: np.ndarray, order: np.ndarray, per_period: np.ndarray
) -> np.ndarray:
    """Windows each source drew before global ``position`` in a phase that began at ``phase_start`` with
    ``phase_counts`` drawn and interleaves by ``order`` (``per_period`` windows each a period)."""
    periods, offset = divmod(position - phase_start, PERIOD)
    return phase_counts + periods * per_period + np.bincount(order[:offset], minlength=len(per_period))


class MixtureSampler(GlobalStream):
    """Indices into the sources' windows concatenated in config order (a ``ConcatDataset``), as one infinite global
    ``GlobalStream`` (rank r of W reads positions consumed + r, + W, ..., as ``StreamSampler``).

    Position g >= phase_start draws source s = order[(g - phase_start) % PERIOD]; it is that source's window number
    k = phase_counts[s] + windows of s since the phase began, and k reads its own stream: epoch k // size, then
    a permutation seeded by (seed, the source's name, epoch). A phase begins where the weights change on resume:
    the windows each source drew so far are kept, and the new weights apply from there."""

    def __init__(
        self,
        sizes: Mapping[str, int],
        weights: Mapping[str, float],
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if list(sizes) != list(weights):
            raise ValueError(f"sizes {list(sizes)} and weights {list(weights)} must name the same sources in order")
        super().__init__(rank=rank, world_size=world_size)
        empty = [name for name, size in sizes.items() if size < 1]
        if empty:
            raise ValueError(f"source {empty[0]!r} has no training windows")
        self.names = list(sizes)
        self.sizes = np.array([int(size) for size in sizes.values()], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        if self.sizes.sum() < world_size:
            raise ValueError(f"{self.sizes.sum()} windows cannot be shared by {world_size} ranks; add data")
        self.shuffle, self.seed = shuffle, seed
        self._set_phase(0, np.zeros(len(self.names), dtype=np.int64), normalised(weights))
        self.resume_note: str | None = None  # set by a resume whose weights differ from the checkpoint's
        self._keys = [zlib.crc32(name.encode()) for name in self.names]  # a source's stream follows its name
        self._perm_cache: dict[int, tuple[int, np.ndarray]] = {}

    def _set_phase(self, start: int, counts: np.ndarray, shares: dict[str, float]) -> None:
        self.phase_start, self.phase_counts, self.weights = int(start), counts.astype(np.int64), shares
        self._order, self._occurrence, self._per_period = interleave(np.array(list(shares.values())))

    # --- positions ------------------------------------------------------------

    def locate(self, position: int) -> tuple[int, int]:
        """(source, that source's window number) at global stream position ``position`` (>= the phase start)."""
        periods, offset = divmod(position - self.phase_start, PERIOD)
        source = int(self._order[offset])
        return source, int(self.phase_counts[source] + periods * self._per_period[source] + self._occurrence[offset])

    def drawn_at(self, position: int) -> np.ndarray:
        """Windows each source drew before global position ``position`` (>= the phase start)."""
        return drawn_before(position, self.phase_start, self.phase_counts, self._order, self._per_period)

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        cached = self._perm_cache.get(source)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, self._keys[source], epoch])
            cached = self._perm_cache[source] = (epoch, rng.permutation(int(self.sizes[source])))
        return cached[1]

    def index_at(self, position: int) -> int:
        """Index into the concatenated sources at global stream position ``position``."""
        source, number = self.locate(position)
        epoch, window = divmod(number, int(self.sizes[source]))
        return int(self.offsets[source] + (self._perm(source, epoch)[window] if self.shuffle else window))

    def epochs(self, samples: int) -> dict[str, float]:
        """Passes over each source's windows once the stream has reached ``samples``."""
        return {name: float(n) / size for name, n, size in zip(self.names, self.drawn_at(samples), self.sizes)}

    # --- the Sampler ------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.sizes.sum()) // self.world_size

    # --- checkpoints ------------------------------------------------------------

    def state_dict(self) -> dict:
        drawn = self.drawn_at(self.consumed)
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "sources": dict(zip(self.names, self.sizes.tolist())),  # windows per source (per epoch)
            "weights": dict(self.weights),  # the shares of the phase in progress, in the order it used
            "phase_start": self.phase_start,
            "phase_counts": dict(zip(self.names, self.phase_counts.tolist())),
            "drawn": dict(zip(self.names, drawn.tolist())),  # windows each source gave so far
        }

    def load_state_dict(self, state: Mapping) -> None:
        if "sources" not in state:
            raise ValueError(
                f"cannot resume the data stream: the checkpoint trained on one corpus (data.source), this config is "
                f"a mixture of {', '.join(self.names)} (data.sources); start a new run, or continued pretraining "
                "from the checkpoint (init.checkpoint)"
            )
        saved = dict(state["sources"])
        if set(saved) != set(self.names):
            added = [name for name in self.names if name not in saved]
            removed = [name for name in saved if name not in self.names]
            parts = [f"added {', '.join(added)}" if added else "", f"removed {', '.join(removed)}" if removed else ""]
            raise ValueError(
                f"cannot resume the data stream: the mixture's sources changed ({'; '.join(p for p in parts if p)}) "
                f"since the checkpoint, which drew from {', '.join(saved)}; keep its sources (a weight may change), "
                "or start a new run"
            )
        for name, size in zip(self.names, self.sizes.tolist()):
            if int(saved[name]) != size:
                raise ValueError(
                    f"cannot resume the data stream: source {name!r} had {saved[name]} windows per epoch in the "
                    f"checkpoint, now {size} (its prepared data or seq_len changed)"
                )
        self.consumed, self.seed = int(state["consumed"]), int(state["seed"])
        self._perm_cache, self._last_iter_start = {}, None
        old = {name: float(share) for name, share in state["weights"].items()}
        old_counts = np.array([int(state["phase_counts"][name]) for name in old], dtype=np.int64)
        self.resume_note = None
        if list(old.items()) == list(self.weights.items()):
            self._set_phase(int(state["phase_start"]), old_counts, old)
            return
        # a new phase from here (new weights, or the sources listed in another order): each source keeps the windows
        # it drew under the checkpoint's phase
        order, _, per_period = interleave(np.array(list(old.values())))
        drawn = dict(zip(old, drawn_before(self.consumed, int(state["phase_start"]), old_counts, order, per_period)))
        self._set_phase(self.consumed, np.array([drawn[name] for name in self.names]), self.weights)
        changed = [f"{n} {old[n]:.3g}→{w:.3g}" for n, w in self.weights.items() if abs(old[n] - w) > 1e-12]
        self.resume_note = f"data weights changed on resume: {', '.join(changed)}" if changed else None
