"""The stream bookkeeping every Lantern datamodule shares (pretraining, SFT, preference pairs, PPO prompts): the
seeded, resumable global order of samples every datamodule draws from (``StreamSampler``), the base of the
datamodules that build their data once and train through a batch plan (``PlanDataModule``: SFT, preference), and
packed pretraining windows over prepared token shards (``PackedDataset``).

Each datamodule shards its data itself: the training sampler is ONE global, seeded stream that every rank reads
its share of (StreamSampler, or SFTBatchPlan over it). Build the Trainer with
`use_distributed_sampler=False` (Lightning would otherwise wrap the sampler in a DistributedSampler and lose the
resumable stream), and call `mark_consumed()` once per micro-batch, inside training_step (trainer.callbacks.
DataProgress does), before any checkpoint of that step is written, so the checkpointed position is exactly the
next unseen sample.

The train DataLoader is a StreamLoader: resumable in Lightning's own sense, so a resume in the middle of an epoch
is exact and Lightning, seeing that, does not warn that the loader is not resumable; the datamodule says once that
the position was resumed."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from data.streams.shards import TokenStream
from data.tokenizer.tokenizer import Tokenizer
from models.loss import IGNORE_INDEX  # F.cross_entropy's default ignore_index

log = logging.getLogger("lantern.data")


class StreamLoader(DataLoader):
    """The train DataLoader over a StreamDataModule's sampler (as ``sampler``, or inside a BatchSampler as
    ``batch_sampler``), with the ``state_dict`` / ``load_state_dict`` that Lightning's loops look for
    (``lightning.pytorch.utilities.types._Stateful``): its state is the stream position, which the datamodule's
    own state holds too, so Lightning's copy restores what the datamodule already did."""

    @property
    def stream(self) -> Any:
        batches = self.batch_sampler
        return batches.sampler if isinstance(batches, BatchSampler) else self.sampler

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["consumed"]) != self.stream.consumed:  # else the datamodule restored it already
            self.stream.load_state_dict(state)


class StreamDataModule(L.LightningDataModule):
    """Rank and world size from the attached trainer, the stream position (mark_consumed / consumed_samples) and
    the checkpoint state, kept pending until train_dataloader() builds the sampler.

    Subclasses set `seq_len` and `micro_batch_size` and hand the sampler they build in train_dataloader() to
    `_attach_sampler`. The sampler needs advance(), consumed, state_dict() and load_state_dict().
    The state is saved in Lightning checkpoints under the subclass's name."""

    seq_len: int
    micro_batch_size: int

    def __init__(self) -> None:
        super().__init__()
        self.train_sampler: Any = None
        # Sampler state restored before the sampler exists (Lightning restores checkpoints after
        # setup() but before train_dataloader()); applied when the sampler is built.
        self._pending_state: dict | None = None

    # --- distributed ---------------------------------------------------------

    @property
    def rank(self) -> int:
        trainer = getattr(self, "trainer", None)
        return int(trainer.global_rank) if trainer is not None else 0

    @property
    def world_size(self) -> int:
        trainer = getattr(self, "trainer", None)
        return int(trainer.world_size) if trainer is not None else 1

    # --- stream position -------------------------------------------------------

    def _attach_sampler(self, sampler: Any) -> Any:
        """Make `sampler` the training stream, at the position of the one it replaces or of a restored checkpoint."""
        if self.train_sampler is not None:  # rebuilt (e.g. reload_dataloaders_every_n_epochs): keep the position
            sampler.load_state_dict(self.train_sampler.state_dict())
        if self._pending_state is not None:
            sampler.load_state_dict(self._pending_state)
            self._pending_state = None
            self._log_resumed(sampler)
        self.train_sampler = sampler
        return sampler

    def mark_consumed(self, micro_batches: int = 1) -> None:
        """Report that every rank trained on `micro_batches` more micro-batches."""
        if self.train_sampler is None:
            raise RuntimeError("mark_consumed() before train_dataloader(): there is no stream to advance")
        self.train_sampler.advance(micro_batches * self.micro_batch_size * self.world_size)

    @property
    def consumed_samples(self) -> int:
        """Global samples trained on so far (summed over ranks)."""
        if self.train_sampler is not None:
            return self.train_sampler.consumed
        return int(self._pending_state["consumed"]) if self._pending_state else 0

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints under this class's name."""
        if self.train_sampler is not None:
            sampler_state = self.train_sampler.state_dict()
        elif self._pending_state is not None:
            sampler_state = dict(self._pending_state)
        else:
            return {}  # nothing trained yet; Lightning stores nothing for an empty dict
        return {"sampler": sampler_state, "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "sampler" not in state_dict:
            return
        if state_dict.get("seq_len", self.seq_len) != self.seq_len:
            raise ValueError(
                f"checkpoint data stream was built with seq_len {state_dict['seq_len']}, now {self.seq_len}: "
                "the stream position cannot be carried over"
            )
        if self.train_sampler is not None:
            self.train_sampler.load_state_dict(state_dict["sampler"])
            self._log_resumed(self.train_sampler)
        else:
            self._pending_state = dict(state_dict["sampler"])

    def _log_resumed(self, sampler: Any) -> None:
        if self.rank == 0:
            log.info(
                "data: resumed exactly where the checkpoint left the training stream, %s samples in",
                f"{sampler.consumed:,}",
            )


class PlanDataModule(StreamDataModule):
    """A StreamDataModule whose data is built once, both splits together (the val hold-out needs the train rows), and
    trained on through a plan of whole micro-batches. Subclasses name the plan (`batch_plan`), the batches its items
    become (`row_batches`) and how both splits are built (`build_data`); sizes and the config arrive checked at load."""

    batch_plan: type[Sampler]  # SFTBatchPlan: rows to micro-batches, in the stream's resumable order
    row_batches: type[Dataset]  # SFTTrainBatches / PreferenceTrainBatches over data.train

    def __init__(
        self,
        config: Any,
        *,
        micro_batch_size: int,
        accumulate_grad_batches: int = 1,
        num_workers: int = 0,
        val_micro_batch_size: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.seq_len = self.config.seq_len
        self.micro_batch_size = micro_batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.num_workers = num_workers
        self.val_micro_batch_size = val_micro_batch_size or micro_batch_size
        self.data: Any = None
        self.tokenizer: Tokenizer | None = None

    # --- setup -----------------------------------------------------------------

    def build_data(self, tokenizer: Tokenizer) -> Any:
        """Both splits and their stats (SFTData, PreferenceData)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """Load and encode both splits (once; the val hold-out needs the train rows)."""
        if self.data is not None:
            return
        self.tokenizer = Tokenizer.load(self.config.tokenizer)
        self.data = self.build_data(self.tokenizer)

    def _require_data(self) -> Any:
        if self.data is None:
            self.setup("fit")
        return self.data

    @property
    def stats(self) -> dict[str, Any]:
        """Loading and encoding numbers per split."""
        return self._require_data().stats

    # --- loaders ---------------------------------------------------------------

    def _loader(self, dataset, loader_class: type[DataLoader] = DataLoader, **kwargs: Any) -> DataLoader:
        return loader_class(
            dataset,
            batch_size=None,  # the datasets return whole micro-batches
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        data = self._require_data()
        plan = self.batch_plan(
            data.train,
            micro_batch_size=self.micro_batch_size,
            accumulate=self.accumulate_grad_batches,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.config.seed,
            shuffle=True,
        )
        return self._loader(self.row_batches(data.train), StreamLoader, sampler=self._attach_sampler(plan))


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
