"""trainer/build.py: what is checked and written when a stage's run folder starts (the Trainer-level checks are
in test_checks.py)."""

from __future__ import annotations

from pathlib import Path

from alignment.schemas.pretrain import PretrainConfig
from trainer.build import check_stage_config
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_a_warmup_longer_than_the_run_is_a_warning(tmp_path, caplog):
    config = load_config(
        PretrainConfig,
        ROOT / "configs/pretrain/tiny.yaml",
        [f"run.out_dir={tmp_path}", "optim.warmup_steps=100", "trainer.max_steps=50"],
    )
    check_stage_config(config)
    assert "optim.warmup_steps (100) exceeds trainer.max_steps (50)" in caplog.text
