"""A WSD cooldown branched from a stable-phase checkpoint into a new run (``checkpoint.resume=PATH``, another
run.name, a shorter trainer.max_steps) ends exactly where a run of that length from the start ends: the step count,
the optimizer's and the schedule's state and the data stream continue. Tiny preset on CPU, a dozen steps a run."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignment.schemas.pretrain import PretrainConfig
from alignment.stages.pretrain import run_pretrain
from models.errors import ConfigError
from trainer.config import load_config
from trainer.optim_config import check_resumed_optim

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "pretrain" / "tiny.yaml"
CORPUS = ROOT / "data" / "corpus" / "tinyshakespeare.txt"


def wsd_run(data_dir: Path, runs: Path, name: str, max_steps: int, decay_steps: int, *overrides: str) -> Path:
    config = load_config(
        PretrainConfig,
        TINY,
        [
            f"data.source=[{CORPUS}]", f"data.out_dir={data_dir}", f"run.out_dir={runs}", f"run.name={name}",
            "logger.kind=csv", "trainer.accelerator=cpu", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=4",
            "checkpoint.keep_last=5", "optim.warmup_steps=2", "optim.schedule=wsd", f"trainer.max_steps={max_steps}",
            f"optim.decay_steps={decay_steps}", *overrides,
        ],
    )  # fmt: skip
    return run_pretrain(config)


def train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as handle:
        return {
            int(row["step"]): float(row["value"]) for row in csv.DictReader(handle) if row["metric"] == "train/loss"
        }


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_cooldown_branched_from_a_stable_checkpoint_equals_a_run_of_that_length(data_dir, tmp_path, optimizer):
    name = f"optim.name={optimizer}"
    # the long run: stable until step 8 of 12; its checkpoint at step 4 is in the stable phase
    long = wsd_run(data_dir, tmp_path, "long", 12, 4, name)
    stable = long / "checkpoints" / "step-00000004.ckpt"
    # the branch: a new run (folder) of 8 steps with a 2-step cooldown, from step 4, without re-running steps 1-4
    branch = wsd_run(data_dir, tmp_path, "cooldown", 8, 2, name, f"checkpoint.resume={stable}")
    reference = wsd_run(data_dir, tmp_path, "short", 8, 2, name)

    branched, straight = train_losses(branch), train_losses(reference)
    assert sorted(branched) == [5, 6, 7, 8]  # the step count continues; steps 1-4 were not trained again
    for step in branched:
        assert branched[step] == pytest.approx(straight[step], abs=1e-6), step
    assert straight[8] < straight[1]
    ours, theirs = (
        load_file(branch / "final" / "model.safetensors"),
        load_file(reference / "final" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6, msg=key)
    saved = torch.load(branch / "checkpoints" / "step-00000008.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 8 and saved["lr_schedulers"][0]["last_epoch"] == 8
    # the cooldown did something: the long run, still stable at step 8, holds other weights there
    stable_at_8 = torch.load(long / "checkpoints" / "step-00000008.ckpt", map_location="cpu", weights_only=True)
    assert any(not torch.equal(saved["state_dict"][k], stable_at_8["state_dict"][k]) for k in saved["state_dict"])

    # a checkpoint past the branch's own cooldown start (step 6) would jump the learning rate: one line, no training
    late = long / "checkpoints" / "step-00000008.ckpt"
    with pytest.raises(
        ConfigError,
        match=r"step-00000008\.ckpt is at step 8, where its run's learning rate was 1 x lr but this run's WSD "
        r"schedule gives 0\.1 x lr \(its cooldown starts at step 6\)",
    ):
        wsd_run(data_dir, tmp_path, "late", 8, 2, name, f"checkpoint.resume={late}")
    assert not (tmp_path / "late" / "checkpoints").exists()
    # and the optimizer state must be the one this run steps
    other = "adamw" if optimizer == "muon" else "muon"
    with pytest.raises(ConfigError, match=rf"holds {optimizer}'s optimizer state but this run has optim.name {other}"):
        wsd_run(data_dir, tmp_path, "other", 8, 2, f"optim.name={other}", f"checkpoint.resume={stable}")


def header(step: int, **optim) -> dict:
    """What ``read_checkpoint_header`` returns of a checkpoint at ``step`` of a 100-step WSD pretraining run."""
    saved = {"name": "adamw", "schedule": "wsd", "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 5, **optim}
    return {"global_step": step, "hyper_parameters": {"config": {"optim": saved, "trainer": {"max_steps": 100}}}}


def stage(*overrides: str) -> PretrainConfig:
    base = ["optim.schedule=wsd", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=5"]
    return load_config(PretrainConfig, TINY, [*base, *overrides])


def test_resuming_inside_a_runs_own_cooldown_is_not_a_branch():
    """An interrupted WSD run resumes in its own cooldown (the same schedule): no refusal."""
    check_resumed_optim(stage("trainer.max_steps=100", "optim.decay_steps=20"), header(95, decay_steps=20), "ckpt")
    check_resumed_optim(stage("trainer.max_steps=100"), header(95), "ckpt")  # 20% by default on both sides


def test_branch_rules_at_the_checkpoint_step():
    check_resumed_optim(stage("trainer.max_steps=60", "optim.decay_steps=10"), header(50, decay_steps=20), "c")
    with pytest.raises(ConfigError, match=r"at step 51, .*\(its cooldown starts at step 50\): branch a cooldown"):
        check_resumed_optim(stage("trainer.max_steps=60", "optim.decay_steps=10"), header(51, decay_steps=20), "c")
    # from the long run's own cooldown into a longer stable phase: the rate would jump up
    longer = stage("trainer.max_steps=200", "optim.decay_steps=20")
    with pytest.raises(ConfigError, match=r"at step 90, where its run's learning rate was 0\.55 x lr"):
        check_resumed_optim(longer, header(90, decay_steps=20, decay_shape="linear"), "c")
    # a cosine checkpoint resumed as WSD after its warmup would jump too; during the warmup the rates agree
    with pytest.raises(ConfigError, match=r"at step 50, .* x lr but this run's WSD schedule gives 1 x lr"):
        check_resumed_optim(stage("trainer.max_steps=100"), header(50, schedule="cosine"), "c")
    check_resumed_optim(stage("trainer.max_steps=100"), header(3, schedule="cosine"), "c")
