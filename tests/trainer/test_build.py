"""trainer/build.py: what is checked and written when a stage's run folder starts (the Trainer-level checks are
in test_checks.py)."""

from __future__ import annotations

from pathlib import Path

from alignment.schemas.pretrain import PretrainConfig
from trainer.build import start_run_directory
from trainer.config import load_config
from trainer.storage import release_run_directory

ROOT = Path(__file__).resolve().parents[2]


def test_a_warmup_longer_than_the_run_is_a_warning(tmp_path, caplog):
    config = load_config(
        PretrainConfig,
        ROOT / "configs/pretrain/tiny.yaml",
        [f"run.out_dir={tmp_path}", "optim.warmup_steps=100", "trainer.max_steps=50"],
    )
    start_run_directory(config, "pretrain")
    release_run_directory(tmp_path / config.run.name)
    assert "optim.warmup_steps (100) exceeds trainer.max_steps (50)" in caplog.text
