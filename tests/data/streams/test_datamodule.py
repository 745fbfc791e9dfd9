"""Tests for data/streams/datamodule.py and data/pretrain/datamodule.py on small hand-made token splits."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.pretrain.datamodule import PretrainDataModule
from data.streams.datamodule import PackedDataset, StreamSampler
from data.streams.shards import TokenStream
from models.loss import IGNORE_INDEX


def write_prepared(
    out_dir: Path, splits: dict[str, list[list[int]]], shard_tokens: int = 1000, vocab_size: int = 4096
) -> Path:
    """Write the on-disk layout data/pretrain/prepare.py produces, directly from token lists."""
    dtype = np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")
    manifest = {
        "version": 1,
        "tokenizer": {"spec": "test", "fingerprint": "0" * 64, "vocab_size": vocab_size},
        "inputs": [],
        "settings": {},
        "dtype": dtype.name,
        "splits": {},
    }
    for split, docs in splits.items():
        d = out_dir / split
        d.mkdir(parents=True)
        stream = np.array([t for doc in docs for t in doc], dtype=dtype)
        shards = []
        for k, start in enumerate(range(0, len(stream), shard_tokens)):
            part = stream[start : start + shard_tokens]
            part.tofile(d / f"shard-{k:05d}.bin")
            shards.append({"file": f"shard-{k:05d}.bin", "tokens": len(part)})
        np.save(d / "doc_offsets.npy", np.concatenate([[0], np.cumsum([len(x) for x in docs])]).astype(np.int64))
        manifest["splits"][split] = {"tokens": len(stream), "documents": len(docs), "shards": shards}
    (out_dir / "manifest.json").write_text(json.dumps(manifest))
    return out_dir


def numbered_docs(lengths: list[int], first: int = 10) -> list[list[int]]:
    """Documents whose tokens are consecutive integers: token value - first == stream position."""
    docs, t = [], first
    for n in lengths:
        docs.append(list(range(t, t + n)))
        t += n
    return docs


DOC_LENGTHS = [5, 3, 7, 4, 6, 9, 2, 8]  # 44 tokens


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return write_prepared(
        tmp_path, {"train": numbered_docs(DOC_LENGTHS), "val": numbered_docs([20, 15], 500)}, shard_tokens=16
    )


# -----------------------------------------------------------------------------
# TokenStream / PackedDataset


def test_token_stream_spans_shards(data_dir):
    stream = TokenStream(data_dir / "train")
    assert len(stream) == 44 and stream.num_documents == len(DOC_LENGTHS) and len(stream._files) == 3
    assert stream.read(0, 44).tolist() == list(range(10, 54))
    assert stream.read(14, 35).tolist() == list(range(24, 45))  # crosses both shard boundaries
    assert stream.read(16, 16).tolist() == []
    assert stream.doc_offsets.tolist() == [0, 5, 8, 15, 19, 25, 34, 36, 44]


def test_truncated_shard_is_reported(data_dir):
    shard = data_dir / "train" / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="shard-00001.bin is missing or truncated"):
        TokenStream(data_dir / "train")


def test_packed_windows_and_targets(data_dir):
    ds = PackedDataset(data_dir / "train", seq_len=8, document_masking=False)
    assert len(ds) == (44 - 1) // 8 == 5
    for i in range(len(ds)):
        sample = ds[i]
        assert set(sample) == {"input_ids", "targets"}
        assert sample["input_ids"].dtype == torch.long and sample["input_ids"].shape == (8,)
        assert sample["input_ids"].tolist() == list(range(10 + 8 * i, 18 + 8 * i))
        assert sample["targets"].tolist() == list(range(11 + 8 * i, 19 + 8 * i))  # shifted by one, no -100
    with pytest.raises(IndexError):
        ds[5]


def test_document_ids_and_cross_document_targets(data_dir):
    ds = PackedDataset(data_dir / "train", seq_len=8)
    offsets = np.array([0, 5, 8, 15, 19, 25, 34, 36, 44])
    for i in range(len(ds)):
        sample = ds[i]
        positions = np.arange(8 * i, 8 * i + 9)
        doc = np.searchsorted(offsets, positions, side="right") - 1
        assert sample["document_ids"].tolist() == (doc[:-1] - doc[0]).tolist()
        assert sample["document_ids"].dtype == torch.long
        for j in range(8):
            if doc[j + 1] != doc[j]:  # the next token starts another document
                assert sample["targets"][j] == IGNORE_INDEX
            else:
                assert sample["targets"][j] == positions[j + 1] + 10
        assert sample["input_ids"].tolist() == (positions[:-1] + 10).tolist()
    # Sample 0 = positions 0..8: doc 0 is 0-4, doc 1 is 5-7, doc 2 starts at 8 (the last target).
    first = ds[0]
    assert first["document_ids"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert first["targets"].tolist() == [11, 12, 13, 14, IGNORE_INDEX, 16, 17, IGNORE_INDEX]
    # Sample 1 starts mid-document: document ids are window-local and restart at 0.
    assert ds[1]["document_ids"].tolist() == [0, 0, 0, 0, 0, 0, 0, 1]


def test_document_ids_work_with_the_model(data_dir):
    """The contract with models/model.py: with a sample's document_ids, the logits of the second
    document in a window equal those of that document run on its own (no attention leak, positions
    restart)."""
    from models.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=4096, multiple_of=16, max_seq_len=64))
    sample = PackedDataset(data_dir / "train", seq_len=8)[0]  # docs: positions 0-4 | 5-7
    ids, docs = sample["input_ids"][None], sample["document_ids"][None]
    with torch.no_grad():
        packed = model(ids, document_ids=docs)
        alone = model(ids[:, 5:])
    torch.testing.assert_close(packed[:, 5:], alone, rtol=1e-4, atol=1e-5)


def test_split_too_short(tmp_path):
    write_prepared(tmp_path, {"train": numbered_docs([30]), "val": numbered_docs([6])})
    with pytest.raises(ValueError) as err:
        PackedDataset(tmp_path / "val", seq_len=8)
    assert str(err.value) == (
        f"split 'val' in {tmp_path} has 6 tokens, fewer than one sequence of seq_len+1=9; lower loader.seq_len or add data"
    )
    assert len(PackedDataset(tmp_path / "val", seq_len=5)) == 1  # exactly seq_len + 1 tokens: one sample


# -----------------------------------------------------------------------------
# StreamSampler


def global_stream(sampler: StreamSampler, start: int, n: int) -> list[int]:
    return [sampler.index_at(g) for g in range(start, start + n)]


def test_every_epoch_is_a_permutation():
    n = 37
    s = StreamSampler(n, seed=5)
    epochs = [global_stream(s, e * n, n) for e in range(4)]
    for perm in epochs:
        assert sorted(perm) == list(range(n))  # no repeats, nothing skipped
    assert len({tuple(p) for p in epochs}) == 4  # reshuffled each epoch
    assert global_stream(StreamSampler(n, seed=5), 0, 3 * n) == [x for p in epochs[:3] for x in p]  # seeded
    assert global_stream(StreamSampler(n, seed=6), 0, n) != epochs[0]
    assert global_stream(StreamSampler(n, shuffle=False), 0, 2 * n) == list(range(n)) * 2


def test_ranks_partition_the_stream():
    n, world = 23, 3
    samplers = [StreamSampler(n, rank=r, world_size=world, seed=1) for r in range(world)]
    assert all(len(s) == n // world for s in samplers)
    per_rank = [list(s) for s in samplers]
    assert all(len(p) == 7 for p in per_rank)
    seen = [x for p in per_rank for x in p]
    assert len(set(seen)) == len(seen)  # ranks never overlap
    # Interleaving the ranks gives back the global stream.
    interleaved = [per_rank[r][k] for k in range(7) for r in range(world)]
    assert interleaved == global_stream(samplers[0], 0, 21)


def test_iteration_does_not_consume_and_advance_continues():
    s = StreamSampler(10, seed=3)
    first = list(s)
    assert s.consumed == 0 and list(s) == first  # iterating (prefetching) does not move the stream
    s.advance(4)
    assert list(s) == global_stream(s, 4, 10)  # next pass starts at position 4, into epoch 1
    assert s.state_dict() == {"consumed": 4, "seed": 3, "num_samples": 10}


def test_resume_mid_epoch_and_different_world_size():
    n, batch = 50, 3
    # Uninterrupted: 2 ranks take 12 micro-batches (crossing an epoch boundary).
    full = [StreamSampler(n, rank=r, world_size=2, seed=9) for r in range(2)]
    trained = []
    for _step in range(12):
        iters = [iter(s) for s in full]  # a fresh loader each step is the worst case for prefetching
        trained.append([[next(it) for _ in range(batch)] for it in iters])
        for s in full:
            s.advance(batch * 2)
    # Interrupted after 5 steps, resumed on 2 ranks: exactly the same next batches.
    state = None
    part = [StreamSampler(n, rank=r, world_size=2, seed=9) for r in range(2)]
    for s in part:
        s.advance(5 * batch * 2)
    state = part[0].state_dict()
    resumed = [StreamSampler(n, rank=r, world_size=2, seed=0) for r in range(2)]
    for s in resumed:
        s.load_state_dict(state)  # the seed comes from the state
    iters = [iter(s) for s in resumed]
    assert [[next(it) for _ in range(batch)] for it in iters] == trained[5]

    # Resumed on 3 ranks: the global stream continues where it stopped.
    three = [StreamSampler(n, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    iters = [iter(s) for s in three]
    got = [[next(it) for _ in range(batch)] for it in iters]
    consumed = 5 * batch * 2
    expected = global_stream(full[0], consumed, batch * 3)
    assert [got[r][k] for k in range(batch) for r in range(3)] == expected
    # ... and the samples are those the 2-rank run would have trained on next.
    continuing = [x for step in trained[5:] for k in range(batch) for x in (step[0][k], step[1][k])]
    assert expected == continuing[: batch * 3]


def test_load_state_dict_rejects_changed_data():
    s = StreamSampler(10)
    with pytest.raises(ValueError, match="12 samples.*now there are 10"):
        s.load_state_dict({"consumed": 3, "seed": 0, "num_samples": 12})


# -----------------------------------------------------------------------------
# PretrainDataModule


@pytest.fixture
def big_data_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 40, size=60).tolist()
    return write_prepared(
        tmp_path, {"train": numbered_docs(lengths), "val": numbered_docs([100, 90, 80], 2000)}, shard_tokens=300
    )


def batches(loader, n: int) -> list[dict]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_datamodule_batches_and_state_round_trip(big_data_dir):
    dm = PretrainDataModule(str(big_data_dir), seq_len=16, micro_batch_size=4, seed=7)
    dm.setup("fit")
    assert dm.tokens_per_micro_batch == 64
    loader = dm.train_dataloader()
    n_samples = len(dm.train_dataset)
    assert len(loader) == n_samples // 4
    got = []
    it = iter(loader)
    for _ in range(5):
        batch = next(it)
        assert batch["input_ids"].shape == batch["targets"].shape == batch["document_ids"].shape == (4, 16)
        got.append(batch)
        dm.mark_consumed()
    state = dm.state_dict()
    assert state["sampler"] == {"consumed": 20, "seed": 7, "num_samples": n_samples}
    nxt = next(it)

    # New datamodule: state restored BEFORE setup / sampler creation (as Lightning does on resume).
    dm2 = PretrainDataModule(str(big_data_dir), seq_len=16, micro_batch_size=4, seed=7)
    dm2.load_state_dict(state)
    assert dm2.state_dict()["sampler"]["consumed"] == 20
    dm2.setup("fit")
    resumed = next(iter(dm2.train_dataloader()))
    for key in nxt:
        assert torch.equal(resumed[key], nxt[key])
    # The five batches already trained on are not repeated.
    seen = {tuple(row.tolist()) for b in got for row in b["input_ids"]}
    assert not seen & {tuple(row.tolist()) for row in resumed["input_ids"]}


def test_datamodule_with_workers_matches_in_process(big_data_dir):
    def first_batches(num_workers: int) -> list[dict]:
        dm = PretrainDataModule(str(big_data_dir), seq_len=16, micro_batch_size=4, num_workers=num_workers)
        dm.setup("fit")
        loader = dm.train_dataloader()
        assert loader.persistent_workers == (num_workers > 0)
        return batches(loader, 3)

    for a, b in zip(first_batches(0), first_batches(2)):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_datamodule_continues_across_epochs(big_data_dir):
    dm = PretrainDataModule(str(big_data_dir), seq_len=16, micro_batch_size=4)
    dm.setup("fit")
    loader = dm.train_dataloader()
    rows = []
    for _ in range(3):  # three Lightning "epochs" over the same loader
        for batch in loader:
            rows += [tuple(r.tolist()) for r in batch["input_ids"]]
            dm.mark_consumed()
    n = len(dm.train_dataset)
    # The first n rows are one full pass: every sample exactly once.
    assert len(set(rows[:n])) == n


def test_datamodule_shards_by_rank(big_data_dir):
    def rank_dm(rank: int) -> PretrainDataModule:
        dm = PretrainDataModule(str(big_data_dir), seq_len=16, micro_batch_size=2, val_batches=3)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        dm.setup("fit")
        return dm

    dms = [rank_dm(0), rank_dm(1)]
    train = [batches(dm.train_dataloader(), 3) for dm in dms]
    rows = [tuple(r.tolist()) for t in train for b in t for r in b["input_ids"]]
    assert len(set(rows)) == len(rows)  # ranks never overlap
    for dm in dms:
        dm.mark_consumed(3)
        assert dm.train_sampler.consumed == 3 * 2 * 2

    vals = [list(dm.val_dataloader()) for dm in dms]
    assert [len(v) for v in vals] == [3, 3]  # val_batches per rank, equal on every rank
    val_rows = [tuple(r.tolist()) for v in vals for b in v for r in b["input_ids"]]
    assert len(set(val_rows)) == len(val_rows) == 12
    # Deterministic and unshuffled: the first 12 validation samples, split between the ranks.
    expected = {tuple(dms[0].val_dataset[i]["input_ids"].tolist()) for i in range(12)}
    assert set(val_rows) == expected
    assert [next(iter(dm.val_dataloader()))["input_ids"].tolist() for dm in dms] == [
        v[0]["input_ids"].tolist() for v in vals
    ]


def test_datamodule_errors(tmp_path, big_data_dir):
    with pytest.raises(ValueError, match="no manifest.json"):
        PretrainDataModule(str(tmp_path / "nothing"), seq_len=8, micro_batch_size=2).setup("fit")
    with pytest.raises(ValueError, match="split 'val'.*lower loader.seq_len"):
        PretrainDataModule(str(big_data_dir), seq_len=500, micro_batch_size=1).setup("fit")
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        PretrainDataModule(str(big_data_dir), seq_len=0, micro_batch_size=1)
    # Set up before a Trainer is attached, then run on more ranks than there are sequences per step.
    dm = PretrainDataModule(str(big_data_dir), seq_len=64, micro_batch_size=8)
    dm.setup("fit")
    dm.trainer = SimpleNamespace(global_rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"fewer than one global micro-batch \(8 x 4 ranks\)"):
        dm.train_dataloader()
    dm = PretrainDataModule(str(big_data_dir), seq_len=16, micro_batch_size=4)
    with pytest.raises(ValueError, match="seq_len 32"):
        dm.load_state_dict({"sampler": {"consumed": 4, "seed": 0, "num_samples": 3}, "seq_len": 32})


def test_lightning_checkpoint_resume(tmp_path, big_data_dir):
    """Through a real Trainer: the datamodule state is saved in the checkpoint and a resumed run
    trains on exactly the batches an uninterrupted run would have (across an epoch boundary)."""
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(4096, 4)
            self.seen: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input_ids"].clone())
            self.trainer.datamodule.mark_consumed()
            return self.emb(batch["input_ids"]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps: int, ckpt_path=None) -> tuple[Tiny, L.Trainer]:
        model = Tiny()
        dm = PretrainDataModule(str(big_data_dir), seq_len=64, micro_batch_size=4, seed=11)
        trainer = L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model, trainer

    full, trainer = fit(8)
    steps_per_epoch = len(trainer.datamodule.train_dataset) // 4
    assert steps_per_epoch < 8  # the run crosses an epoch boundary
    first, trainer = fit(3)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["PretrainDataModule"]["sampler"]["consumed"] == 12
    resumed, _ = fit(8, ckpt_path=str(ckpt))
    trained = first.seen + resumed.seen
    assert len(trained) == 8
    for a, b in zip(trained, full.seen):
        assert torch.equal(a, b)
