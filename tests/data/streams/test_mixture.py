"""Tests for data/streams/mixture.py (MixtureSampler) and a mixture through PretrainDataModule: shares by weight,
the same stream on any world size and across resumes, weight changes between phases, per-source validation."""

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.pretrain.datamodule import PretrainDataModule
from data.streams.datamodule import StreamSampler
from data.streams.mixture import PERIOD, MixtureSampler, interleave
from tests.data.streams.test_datamodule import numbered_docs, write_prepared


def shares_over(sampler: MixtureSampler, start: int, n: int = 10_000) -> np.ndarray:
    sources = [sampler.locate(start + k)[0] for k in range(n)]
    return np.bincount(sources, minlength=len(sampler.names)) / n


@pytest.mark.parametrize(
    "weights",
    [{"a": 0.7, "b": 0.3}, {"a": 1.0, "b": 2.0, "c": 3.7}, {"web": 0.05, "code": 0.9, "math": 0.05}],
    ids=["two", "three-odd", "skewed"],
)
def test_shares_over_10000_windows_within_one_percent(weights):
    sampler = MixtureSampler(dict.fromkeys(weights, 997), weights, seed=3)
    expected = np.array(list(weights.values())) / sum(weights.values())
    for start in (0, 4_321, PERIOD - 17, 10**9):  # any stretch of the stream, across a period boundary too
        measured = shares_over(sampler, start)
        assert np.abs(measured - expected).max() < 0.01, (start, measured, expected)
        assert np.abs(measured - expected).max() <= 3 / 10_000  # by construction: a few windows at most


def test_equal_weights_alternate_and_every_source_draws():
    order, _, counts = interleave(np.array([0.5, 0.5]))
    assert order[:6].tolist() == [0, 1, 0, 1, 0, 1]
    _, _, counts = interleave(np.array([1e-9, 1 - 1e-9]))
    assert counts.tolist() == [1, PERIOD - 1]  # a share under 1 / PERIOD still draws


def test_each_source_reads_its_own_windows_in_order_and_repeats_by_epoch():
    sampler = MixtureSampler({"big": 50, "small": 7}, {"big": 0.5, "small": 0.5}, seed=1)
    numbers: dict[int, list[int]] = {0: [], 1: []}
    indices: dict[int, list[int]] = {0: [], 1: []}
    for position in range(100):
        source, number = sampler.locate(position)
        numbers[source].append(number)
        indices[source].append(sampler.index_at(position))
    assert numbers[0] == list(range(50)) and numbers[1] == list(range(50))
    assert sorted(indices[0]) == list(range(50))  # one epoch of big: a permutation of its windows
    small = [index - 50 for index in indices[1]]  # small's windows follow big's in the concatenation
    assert all(sorted(small[e * 7 : e * 7 + 7]) == list(range(7)) for e in range(7))  # whole epochs of small
    assert small[:7] != small[7:14]  # each epoch its own order
    assert sampler.epochs(100) == {"big": 1.0, "small": 50 / 7}


def test_same_stream_on_any_world_size():
    sizes, weights = {"a": 40, "b": 13, "c": 9}, {"a": 5, "b": 3, "c": 2}
    single = MixtureSampler(sizes, weights, seed=7)
    single.consumed = 6
    expected = [single.index_at(6 + k) for k in range(40)]
    ranks = [MixtureSampler(sizes, weights, rank=r, world_size=2, seed=7) for r in range(2)]
    for sampler in ranks:
        sampler.consumed = 6
    per_rank = [list(iter(sampler))[:20] for sampler in ranks]
    interleaved = [index for pair in zip(*per_rank) for index in pair]
    assert interleaved == expected  # rank r reads positions consumed + r, + 2, ...
    assert list(iter(single))[:40] == expected


def test_resume_mid_stream_continues_exactly():
    sizes, weights = {"a": 30, "b": 11}, {"a": 0.6, "b": 0.4}
    full = MixtureSampler(sizes, weights, seed=5)
    stream = list(iter(full))[:30]
    first = MixtureSampler(sizes, weights, seed=5)
    first.advance(12)
    state = first.state_dict()
    assert state["consumed"] == 12 and state["phase_start"] == 0 and state["weights"] == {"a": 0.6, "b": 0.4}
    assert sum(state["drawn"].values()) == 12 and state["sources"] == sizes
    resumed = MixtureSampler(sizes, weights, seed=0)  # the seed comes from the checkpoint
    resumed.load_state_dict(state)
    assert resumed.resume_note is None
    assert list(iter(resumed))[:18] == stream[12:]


def test_weight_change_on_resume_starts_a_phase_from_the_counts_so_far():
    sizes = {"a": 500, "b": 500}
    old = MixtureSampler(sizes, {"a": 0.7, "b": 0.3}, seed=2)
    old.advance(1_000)
    drawn = old.state_dict()["drawn"]
    assert drawn == {"a": 700, "b": 300}

    new = MixtureSampler(sizes, {"a": 1.0, "b": 1.0}, seed=2)
    new.load_state_dict(old.state_dict())
    assert new.resume_note == "data weights changed on resume: a 0.7→0.5, b 0.3→0.5"
    assert new.phase_start == 1_000 and dict(zip(new.names, new.phase_counts.tolist())) == drawn
    # the next windows of each source are the ones after those it drew: nothing repeated, nothing skipped
    numbers = [new.locate(1_000 + k) for k in range(10_000)]
    for source, name in enumerate(new.names):
        mine = [number for s, number in numbers if s == source]
        assert mine == list(range(drawn[name], drawn[name] + len(mine)))
    assert np.abs(shares_over(new, 1_000) - 0.5).max() < 0.01
    # a checkpoint of the new phase resumes it as it is
    new.advance(40)
    again = MixtureSampler(sizes, {"a": 1.0, "b": 1.0}, seed=2)
    again.load_state_dict(new.state_dict())
    assert again.resume_note is None and again.phase_start == 1_000
    assert [again.index_at(1_040 + k) for k in range(50)] == [new.index_at(1_040 + k) for k in range(50)]


def test_other_sources_or_sizes_are_refused_on_resume():
    state = MixtureSampler({"a": 10, "b": 10}, {"a": 1, "b": 1}).state_dict()
    with pytest.raises(ValueError, match=r"sources changed \(added c; removed b\)"):
        MixtureSampler({"a": 10, "c": 10}, {"a": 1, "c": 1}).load_state_dict(state)
    with pytest.raises(ValueError, match="source 'b' had 10 windows per epoch in the checkpoint, now 12"):
        MixtureSampler({"a": 10, "b": 12}, {"a": 1, "b": 1}).load_state_dict(state)
    with pytest.raises(ValueError, match="trained on one corpus"):
        MixtureSampler({"a": 10, "b": 10}, {"a": 1, "b": 1}).load_state_dict(StreamSampler(20).state_dict())
    with pytest.raises(ValueError, match="trained on a mixture of a, b"):
        StreamSampler(20).load_state_dict(state)


# -----------------------------------------------------------------------------
# through PretrainDataModule


@pytest.fixture
def mixture_dir(tmp_path: Path) -> Path:
    """Two prepared sources whose tokens tell them apart: a's below 1000, b's from 5000."""
    write_prepared(tmp_path / "a", {"train": numbered_docs([30] * 20), "val": numbered_docs([40, 40], 900)})
    write_prepared(tmp_path / "b", {"train": numbered_docs([25] * 12, 5000), "val": numbered_docs([50], 9000)})
    return tmp_path


def test_datamodule_draws_by_weight_and_validates_per_source(mixture_dir, caplog):
    dm = PretrainDataModule(str(mixture_dir), seq_len=8, micro_batch_size=4, seed=1, sources={"a": 3, "b": 1})
    dm.trainer = SimpleNamespace(global_rank=0, world_size=1, max_steps=50, accumulate_grad_batches=1)
    dm.setup("fit")
    assert dm.source_names == ["a", "b"]
    with caplog.at_level(logging.INFO, logger="lantern.data"):
        loader = dm.train_dataloader()
    assert "data mixture: a 75.0% of 74 windows, 2.03 epochs by step 50 (repeats); b 25.0% of 37 windows" in caplog.text
    rows = [row for _, batch in zip(range(25), loader) for row in batch["input_ids"]]
    from_b = sum(int(row[0] >= 5000) for row in rows)
    assert from_b == 25  # a quarter of 100 windows, exactly
    vals = dm.val_dataloader()
    assert len(vals) == 2
    first = [next(iter(v))["input_ids"] for v in vals]
    assert (first[0] < 1000).all() and (first[1] >= 9000).all()


def test_datamodule_resume_with_other_weights_logs_one_line(mixture_dir, caplog):
    dm = PretrainDataModule(str(mixture_dir), seq_len=8, micro_batch_size=4, sources={"a": 3, "b": 1})
    dm.setup("fit")
    dm.train_dataloader()
    dm.mark_consumed(5)
    state = dm.state_dict()

    dm2 = PretrainDataModule(str(mixture_dir), seq_len=8, micro_batch_size=4, sources={"a": 1, "b": 1})
    dm2.trainer = SimpleNamespace(global_rank=0, world_size=1, global_step=5, max_steps=-1)
    dm2.load_state_dict(state)
    with caplog.at_level(logging.INFO, logger="lantern.data"):
        loader = dm2.train_dataloader()
    lines = [r.getMessage() for r in caplog.records if "resume" in r.getMessage()]
    assert lines == ["data weights changed on resume: a 0.75→0.5, b 0.25→0.5; continuing at step 5 (20 samples in)"]
    assert dm2.consumed_samples == 20
    batch = next(iter(loader))["input_ids"]
    assert torch.equal(batch[:, 0] >= 5000, torch.tensor([False, True, False, True]))  # alternating from here


def test_datamodule_names_the_source_it_cannot_read(mixture_dir, tmp_path):
    with pytest.raises(ValueError, match="data source 'c': no manifest.json"):
        PretrainDataModule(str(mixture_dir), seq_len=8, micro_batch_size=4, sources={"a": 1, "c": 1}).setup("fit")
    with pytest.raises(ValueError, match="data source 'b': split 'val'"):
        PretrainDataModule(str(mixture_dir), seq_len=60, micro_batch_size=1, sources={"a": 1, "b": 1}).setup("fit")
