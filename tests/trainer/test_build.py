"""trainer/build.py: what a stage readies when it starts (the Trainer-level checks are in test_checks.py)."""

from __future__ import annotations

from pathlib import Path

from alignment.schemas.pretrain import PretrainConfig
from trainer.build import check_stage_config
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_a_warmup_longer_than_the_run_is_a_warning_at_load(tmp_path, caplog):
    config = load_config(
        PretrainConfig,
        ROOT / "configs/pretrain/tiny.yaml",
        [f"run.out_dir={tmp_path}", "optim.warmup_steps=100", "trainer.max_steps=50"],
    )
    assert "optim.warmup_steps (100) exceeds trainer.max_steps (50)" in caplog.text
    caplog.clear()
    check_stage_config(config, (None, []))  # checked once, at load
    assert "exceeds" not in caplog.text


def test_a_trainer_does_not_advertise_lightnings_cloud_logger(tmp_path):
    """Lightning's "💡 Tip: ... litlogger" came with every run and every test; its other messages still do."""
    import logging

    import lightning as L

    import trainer.build  # noqa: F401 - what every stage imports before it builds its Trainer

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero.addHandler(handler)
    try:
        L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_progress_bar=False)
    finally:
        rank_zero.removeHandler(handler)
    assert said, "Lightning said nothing at all: the test no longer sees its messages"
    assert not [line for line in said if "litlogger" in line], said
