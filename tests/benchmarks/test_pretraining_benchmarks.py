"""The arithmetic of the pretraining benchmarks (benchmarks/pretrain_recipes.py, continued_pretraining.py): steps to
a target loss read off validation curves, and bits-per-byte changes paired over documents with their standard error."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.continued_pretraining import bits_per_byte, paired_change
from benchmarks.pretrain_recipes import finished, mean_se, steps_to_reach, summarise


def test_steps_to_reach_interpolates_between_validations():
    curve = [(10, 5.0), (20, 4.0), (30, 3.0)]
    assert steps_to_reach(curve, 4.5) == pytest.approx(15.0)
    assert steps_to_reach(curve, 3.0) == pytest.approx(30.0)
    assert steps_to_reach(curve, 5.5) == pytest.approx(10.0)  # reached at the first validation
    assert steps_to_reach(curve, 2.9) is None


def test_summary_ratios_are_against_the_baselines_mean_final_loss():
    runs = {
        "adamw_cosine": {0: {"curve": [(10, 4.0), (20, 3.0)], "final_val_loss": 3.0},
                         1: {"curve": [(10, 4.2), (20, 3.2)], "final_val_loss": 3.2}},
        "muon_wsd": {0: {"curve": [(10, 3.1), (20, 2.5)], "final_val_loss": 2.5},
                     1: {"curve": [(10, 3.3), (20, 2.7)], "final_val_loss": 2.7}},
    }  # fmt: skip
    summary = summarise(runs)
    assert summary["target_val_loss"] == pytest.approx(3.1)
    # the baseline reaches 3.1 at 19 (seed 0) and never (seed 1); Muon at 10 (its first validation) and 10 + 10 * 0.2 / 0.6
    assert summary["adamw_cosine"]["steps_to_target"]["mean"] == pytest.approx(19.0)
    assert summary["adamw_cosine"]["runs_reaching_target"] == "1 of 2"
    assert summary["muon_wsd"]["steps_to_target"]["mean"] == pytest.approx((10 + 10 + 2 / 0.6) / 2)
    assert summary["muon_wsd"]["final_val_loss"] == mean_se([2.5, 2.7])
    assert summary["muon_wsd"]["runs_reaching_target"] == "2 of 2"
    assert summary["muon_wsd"]["steps_ratio_to_baseline"]["mean"] == pytest.approx((10 + 10 + 2 / 0.6) / 2 / 19.0)


def test_a_run_is_finished_once_validated_at_its_last_step(tmp_path):
    assert not finished(tmp_path, 20)  # no metrics yet: trained (or resumed)
    rows = ["metric,step,value", "train/loss,20,3.0", "val/loss,10,4.0"]
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    assert not finished(tmp_path, 20)  # interrupted after step 20's training loss, before its validation
    (tmp_path / "metrics.csv").write_text("\n".join([*rows, "val/loss,20,3.5"]) + "\n")
    assert finished(tmp_path, 20) and not finished(tmp_path, 30)


def test_paired_bits_per_byte_change_and_its_standard_error():
    rng = random.Random(0)
    sizes = [rng.randint(100, 1000) for _ in range(400)]
    before = [(-1.2 * n * math.log(2), n) for n in sizes]  # 1.2 bits per byte exactly
    after = [(-(1.0 + rng.gauss(0, 0.05)) * n * math.log(2), n) for n in sizes]  # 1.0 ± noise per document
    assert bits_per_byte(before) == pytest.approx(1.2)
    change = paired_change(before, after)
    assert change["change"] == pytest.approx(-0.2, abs=0.01)
    assert 0.0005 < change["se"] < 0.01  # about 0.05 / sqrt(400) per byte-weighted document
    same = paired_change(before, before)
    assert same == {"change": 0.0, "se": 0.0}
