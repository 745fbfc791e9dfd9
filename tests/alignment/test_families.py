"""Every model family through every stage: a tiny random model of each family (models/families.py) beyond Llama runs
SFT (full and LoRA), DPO and GRPO from its checkpoint, keeps its family in what each stage writes, and its SFT model
exported as GGUF by ``lantern export`` loads in transformers with Lantern's logits (f32)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from alignment.schemas.dpo import DPOConfig
from alignment.schemas.rl import GRPOConfig
from alignment.schemas.sft import SFTConfig
from alignment.stages.dpo import run_dpo
from alignment.stages.grpo import run_grpo
from alignment.stages.sft import run_sft
from data.demo.tasks import write_demo_dataset
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import load_checkpoint, load_model_config, save_checkpoint
from models.model import ModelConfig, Transformer
from tests.alignment.conftest import TINY
from tests.helpers import family_block, run_cli
from trainer.config import load_config
from trainer.plots import read_metrics_csv

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
# each family's own block options, on the tiny shape (Qwen3: QK norm, tied, heads 128 wide as in every Qwen3, which
# transformers' GGUF reader assumes)
FAMILIES = {
    "qwen3": dict(**family_block("Qwen3ForCausalLM"), head_dim_override=128, tie_embeddings=True),
    # Gemma 3: its block, 256-wide heads and scores scaled by 1/sqrt(256), both layers local with a window (8) shorter
    # than the rows (as llama.cpp and transformers' GGUF reader take Gemma 3: every 6th layer global, local RoPE base
    # 10,000)
    "gemma3": dict(
        **family_block("Gemma3ForCausalLM"),
        head_dim_override=256,
        attention_scale_dim=256.0,
        sliding_window=8,
        sliding_window_pattern=6,
        rope_local_theta=10000.0,
        tie_embeddings=True,
    ),
}
SHORT = ["trainer.max_steps=2", "trainer.val_every_n_steps=1000", "checkpoint.every_n_steps=2", "logger.kind=csv"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> dict:
    """The family's tiny model saved as a stage would, with the bundled tokenizer, and the demo data."""
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, **FAMILIES[request.param]}))
    for parameter in model.parameters():  # less flat than the 0.02 init: sampled replies vary
        if parameter.ndim == 2:
            nn.init.normal_(parameter, std=0.08)
    tokenizer = Tokenizer.load("default")
    demo = write_demo_dataset(root / "demo", n_train=40, n_val=8, n_pairs=16, seed=0)
    return {
        "name": request.param,
        "root": root,
        "config": model.config,
        "checkpoint": save_checkpoint(model, root / "start", tokenizer_path=tokenizer.path),
        **demo,
    }


def stage_config(schema, preset: str, family: dict, out: str, *overrides: str):
    return load_config(schema, ROOT / preset, [f"run.out_dir={family['root'] / out}", *SHORT, *overrides])


def trained(run_dir: Path, family: dict, loss: str = "train/loss") -> Path:
    """The run's final model: finite losses on the way, and the family it started as."""
    losses = read_metrics_csv(run_dir / "metrics.csv")[loss]
    assert len(losses) == 2 and all(math.isfinite(loss) for _, loss in losses)
    assert load_model_config(run_dir / "final") == family["config"]
    return run_dir / "final"


def sft(family: dict, out: str, *overrides: str) -> Path:
    config = stage_config(SFTConfig, "configs/sft/tiny.yaml", family, out, f"init.checkpoint={family['checkpoint']}",
                          f"data.train=[{family['train']}]", f"data.val=[{family['val']}]", "eval.generations=2",
                          *overrides)  # fmt: skip
    return run_sft(config)


@pytest.fixture(scope="module")
def sft_run(family) -> Path:
    return sft(family, "sft")


def test_sft_trains_the_family_fully_and_with_lora(family, sft_run):
    trained(sft_run, family)
    trained(sft(family, "sft-lora", "peft.kind=lora", "peft.rank=4", "peft.alpha=8"), family)


def test_dpo_and_grpo_train_the_family(family):
    dpo = stage_config(DPOConfig, "configs/dpo/tiny.yaml", family, "dpo", f"init.policy={family['checkpoint']}",
                       f"data.train=[{family['pairs']}]", "data.seq_len=192")  # fmt: skip
    trained(run_dpo(dpo), family)
    grpo = stage_config(GRPOConfig, "configs/grpo/tiny.yaml", family, "grpo", f"init.policy={family['checkpoint']}",
                        f"data.train=[{family['train_prompts']}]", f"data.val=[{family['prompts']}]",
                        "eval.every_n_rollouts=1000", "eval.pass_k_prompts=0")  # fmt: skip
    trained(run_grpo(grpo), family, loss="grpo/policy_loss")


def test_the_gguf_export_loads_in_transformers_with_the_same_logits(family, sft_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    out = tmp_path / f"{family['name']}.gguf"
    checkpoint = sorted((sft_run / "checkpoints").glob("*.ckpt"))[-1]
    run_cli("export", str(checkpoint), str(out), "--format", "gguf", "--dtype", "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    ids = torch.tensor([Tokenizer.load("default").encode("ROMEO: What, ho! Who is there?", bos=True)])
    with torch.no_grad():
        assert (hf(ids).logits - load_checkpoint(sft_run / "final")(ids)).abs().max().item() <= 1e-4
