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
    check_stage_config(config)  # checked once, at load
    assert "exceeds" not in caplog.text
