"""Reward-model stage: Bradley-Terry loss, reading the score at the <|eot_id|>, accumulation invariance, a
separable toy run with export, tokenizer checks, and (slow) 2-process FSDP against a single process."""

import csv
import json
import math
import random
from pathlib import Path

import lightning as L
import pytest
import torch

from alignment.schemas.reward import RMConfig
from alignment.shared.rewards import normalize_reward
from alignment.stages.reward import (
    RewardModule,
    bradley_terry_loss,
    load_initial_reward_model,
    normalization_from_moments,
    reward_moments,
    run_rm,
)
from data.demo.tasks import write_demo_dataset
from data.preference.pairs import build_preference_data
from data.tokenizer.tokenizer import Tokenizer
from models.heads import load_scalar_model
from tests.helpers import CaptureGradients, run_cli, words, write_jsonl
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_pairs(tmp_path_factory) -> Path:
    return write_demo_dataset(tmp_path_factory.mktemp("demo"), n_train=10, n_val=10, n_pairs=200, seed=0)["pairs"]


@pytest.fixture(scope="module")
def toy_pairs(tmp_path_factory) -> Path:
    """Separable pairs: random prompts, the chosen reply is always "yes" and the rejected one "no"."""
    rng = random.Random(0)
    records = [{"prompt": words(rng, rng.randint(2, 12)), "chosen": "yes", "rejected": "no"} for _ in range(200)]
    return write_jsonl(tmp_path_factory.mktemp("toy") / "toy.jsonl", records)


def rm_config(pairs: Path, out_dir: Path, *overrides: str) -> RMConfig:
    return load_config(
        RMConfig,
        ROOT / "configs/rm/tiny.yaml",
        [f"data.train=[{pairs}]", f"run.out_dir={out_dir}", "logger.kind=none", *overrides],
    )


def read_metric(run_dir: Path, csv_name: str, metric: str) -> list[tuple[int, float]]:
    with open(run_dir / csv_name, newline="") as handle:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(handle) if r["metric"] == metric]


# ---- the loss and the normalisation helpers ----


def test_bradley_terry_loss_matches_hand_computed_values():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    by_hand = [math.log1p(math.exp(-d)) for d in (2.0, 0.0, -2.0)]  # -log sigmoid(d) = log(1 + e^-d)
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected), torch.tensor(by_hand))
    with_margin = [math.log1p(math.exp(-(d - 1.0))) for d in (2.0, 0.0, -2.0)]
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected, margin=1.0), torch.tensor(with_margin))
    assert bradley_terry_loss(chosen, rejected, margin=1.0).tolist() == pytest.approx([0.3132617, 1.3132617, 3.0485874])
    # finite and exact far from zero, where log(sigmoid(d)) would underflow to log(0)
    torch.testing.assert_close(
        bradley_terry_loss(torch.tensor([-100.0, 100.0]), torch.tensor([0.0, 0.0])), torch.tensor([100.0, 0.0])
    )


def test_reward_moments_add_up_over_batches_to_the_mean_and_std():
    rewards = torch.randn(101, generator=torch.Generator().manual_seed(0)) * 3 + 2
    moments = reward_moments(rewards[:40]) + reward_moments(rewards[40:])
    stats = normalization_from_moments(moments)
    assert stats["reward_mean"] == pytest.approx(rewards.double().mean().item())
    assert stats["reward_std"] == pytest.approx(rewards.double().std(unbiased=False).item())
    normalized = normalize_reward(rewards, stats)
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-5) and normalized.std(
        unbiased=False
    ).item() == pytest.approx(1.0, abs=1e-4)
    assert normalize_reward(rewards, {}) is rewards


# ---- the score is read at the <|eot_id|> ----


def test_score_is_read_at_the_eot_whatever_the_padding(toy_pairs, tmp_path):
    config = rm_config(toy_pairs, tmp_path)
    tokenizer = Tokenizer.load("default")
    module = RewardModule(config, load_initial_reward_model(config).eval(), tokenizer)
    pairs = build_preference_data(config.data, tokenizer).train
    batch = pairs.batch(range(6), step_pairs=6)
    padding = batch["document_ids"] == 1
    assert padding.any()
    noisy = dict(batch, input_ids=torch.where(padding, torch.randint(0, 3840, padding.shape), batch["input_ids"]))
    extra = torch.randint(0, 3840, (12, 16))  # 16 more columns of padding with other content
    longer = dict(
        batch,
        input_ids=torch.cat([noisy["input_ids"], extra], dim=1),
        document_ids=torch.cat([batch["document_ids"], torch.ones_like(extra)], dim=1),
    )
    rows = torch.arange(12)
    assert (batch["input_ids"][rows, batch["score_index"]] == tokenizer.eot_id).all()
    with torch.no_grad():
        reference = torch.cat(module.rewards(batch))
        torch.testing.assert_close(torch.cat(module.rewards(noisy)), reference, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.cat(module.rewards(longer)), reference, rtol=1e-5, atol=1e-5)
        # while the scores after the <|eot_id|> do change with the padding: reading there would be wrong
        after = (batch["score_index"] + 1).unsqueeze(1)
        plain = module.model(batch["input_ids"], document_ids=batch["document_ids"]).gather(1, after)
        changed = module.model(noisy["input_ids"], document_ids=noisy["document_ids"]).gather(1, after)
        assert not torch.allclose(plain, changed)


# ---- training ----


def first_step_gradients(
    pairs: Path, out_dir: Path, micro_batch: int, accumulate: int, accelerator: str = "cpu"
) -> dict[str, torch.Tensor]:
    capture = CaptureGradients()
    config = rm_config(
        pairs, out_dir,
        f"loader.micro_batch_size={micro_batch}", f"trainer.accumulate_grad_batches={accumulate}", "trainer.max_steps=1",
        "trainer.val_every_n_steps=1000", "optim.grad_clip=null", "loss.margin=0.5", "loss.normalize_rewards=false",
        # True fp32 matmuls: on CUDA the default (auto = high) is TF32, whose 10-bit mantissa rounds every
        # matmul input to ~5e-4 relative, ~1e-3 in the products, far above the 1e-4 this comparison needs.
        f"trainer.accelerator={accelerator}", "trainer.float32_matmul_precision=highest",
    )  # fmt: skip
    run_rm(config, extra_callbacks=[capture])
    return capture.gradients


ACCELERATORS = [
    "cpu",
    pytest.param("gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_gradient_accumulation_invariance(demo_pairs, tmp_path, accelerator):
    """micro-batch 1 x accumulation 8 gives the gradient of 8 x 1: each pair's loss is divided by the pairs of
    the whole step, not averaged per micro-batch. Gradients, not weights: Adam's first step hides scale errors.

    On CUDA this once failed (a w1 gradient off by more than 1e-4): not the normalisation (a wrong one is off
    by a factor, in every tensor) but TF32 matmuls; both runs here use true fp32 (float32_matmul_precision)."""
    one_by_eight = first_step_gradients(demo_pairs, tmp_path / "a", 1, 8, accelerator)
    eight_by_one = first_step_gradients(demo_pairs, tmp_path / "b", 8, 1, accelerator)
    assert torch.get_float32_matmul_precision() == "highest"
    assert next(iter(one_by_eight.values())).device.type == ("cuda" if accelerator == "gpu" else "cpu")
    assert one_by_eight.keys() == eight_by_one.keys() and "head.proj.weight" in one_by_eight
    assert "backbone.output.weight" not in one_by_eight  # the unused LM head is frozen
    for name, gradient in one_by_eight.items():
        # Micro-batches are padded to their own longest side, so matmul shapes (and float rounding) differ:
        # equal to ~1e-5 of each tensor's scale, where a wrong normalisation would be off by a factor.
        atol = max(1e-5 * gradient.abs().max().item(), 1e-7)
        torch.testing.assert_close(gradient, eight_by_one[name], rtol=1e-4, atol=atol, msg=name)


class KeepModule(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:  # runs after ExportFinal (extra callbacks come last)
        self.module, self.datamodule = pl_module, trainer.datamodule


def test_separable_pairs_are_learned_and_the_export_scores_the_same(toy_pairs, tmp_path):
    keep = KeepModule()
    config = rm_config(
        toy_pairs,
        tmp_path,
        "data.val_fraction=0.2",
        "trainer.max_steps=24",
        "trainer.val_every_n_steps=12",
        "checkpoint.every_n_steps=100",
    )
    run_dir = run_rm(config, extra_callbacks=[keep])
    accuracy = read_metric(run_dir, "accuracy.csv", "val/accuracy")
    assert [step for step, _ in accuracy] == [12, 24] and accuracy[-1][1] >= 0.95
    assert read_metric(run_dir, "accuracy.csv", "train/accuracy") and read_metric(run_dir, "metrics.csv", "train/loss")
    assert (run_dir / "loss.png").is_file() and (run_dir / "accuracy.png").is_file()
    stats = json.loads((run_dir / "data_stats.json").read_text())
    assert stats["train"]["pairs"] == 160 and stats["val"]["pairs"] == 40

    model, metadata = load_scalar_model(run_dir / "final")
    assert metadata["stage"] == "rm" and metadata["step"] == 24 and metadata["tokenizer"].endswith(".tiktoken")
    batches = list(keep.datamodule.eval_batches("train"))
    exported = RewardModule(config, model.eval(), keep.module.tokenizer)
    with torch.no_grad():
        rewards = [torch.cat(exported.rewards(b)) for b in batches]
        torch.testing.assert_close(rewards[0], torch.cat(keep.module.rewards(batches[0])), rtol=1e-5, atol=1e-5)
    # the exported normalisation is the mean and std over both sides of every train pair (160 < 512)
    every = torch.cat([r.view(2, -1)[:, b["pair_mask"]].flatten() for r, b in zip(rewards, batches)])
    assert every.numel() == 320
    assert metadata["reward_mean"] == pytest.approx(every.mean().item(), abs=1e-4)
    assert metadata["reward_std"] == pytest.approx(every.std(unbiased=False).item(), rel=1e-4)


# ---- checks before compute ----


def test_a_tokenizer_larger_than_the_model_is_an_error_before_compute(toy_pairs, tmp_path):
    config = rm_config(toy_pairs, tmp_path, "data.tokenizer=cl100k_base")
    with pytest.raises(ValueError, match=r"100512 tokens but the model \(model.vocab_size\) has vocab_size 4096"):
        run_rm(config)
    assert not (tmp_path / config.run.name).exists()


def test_initial_model_is_the_sft_checkpoint_and_its_tokenizer_is_enforced(toy_pairs, tmp_path):
    from models.formats.checkpoint import save_checkpoint
    from models.model import ModelConfig, Transformer

    torch.manual_seed(1)
    sft = Transformer(ModelConfig.from_preset("tiny"))
    default = Tokenizer.load("default")
    folder = save_checkpoint(sft, tmp_path / "sft", tokenizer_path=default.path)
    model = load_initial_reward_model(rm_config(toy_pairs, tmp_path, f"init.checkpoint={folder}"))
    for name, tensor in sft.state_dict().items():
        torch.testing.assert_close(model.backbone.state_dict()[name], tensor, rtol=0, atol=0)
    assert abs(model.head.proj.weight.std().item() - 1 / math.sqrt(129)) < 0.03 and model.head.proj.bias.item() == 0
    # another tokenizer of the same size would silently remap every id
    lines = Path(default.path).read_bytes().splitlines(keepends=True)
    first, second = lines[-2].split(b" "), lines[-1].split(b" ")
    other = tmp_path / "other.tiktoken"
    other.write_bytes(
        b"".join(lines[:-2]) + second[0] + b" " + first[1] + first[0] + b" " + second[1]
    )  # two tokens swap ids
    with pytest.raises(ValueError, match="set data.tokenizer="):
        run_rm(rm_config(toy_pairs, tmp_path, f"init.checkpoint={folder}", f"data.tokenizer={other}"))


def test_presets_load():
    tiny = load_config(RMConfig, ROOT / "configs/rm/tiny.yaml")
    assert tiny.init.checkpoint is None and tiny.model.dim == 128 and tiny.data.val_fraction == 0.1
    assert tiny.logger.kind == "csv" and tiny.trainer.max_steps == 20
    demo = load_config(RMConfig, ROOT / "configs/rm/shakespeare.yaml")
    assert demo.init.checkpoint == "runs/sft-shakespeare/final" and demo.logger.kind == "wandb"
    assert demo.data.train == ["runs/data/demo/pairs.jsonl"] and demo.loss.normalize_rewards


def test_cli_has_the_rm_stage(capsys):
    from alignment.commands.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "train a reward model on preference pairs" in capsys.readouterr().out


# ---- distributed ----


@pytest.mark.slow
def test_fsdp_rm_on_two_processes_matches_single_process(demo_pairs, tmp_path):
    """2-process FSDP2 (fp32, CPU, gloo) against one process with the same global batch of 8 pairs: the same
    pairs per step, so per-step losses agree to float rounding: within 1e-4 (measured: <= 1e-5 after 6 Adam
    steps), and the exported reward mean / std within 1e-3 relative."""
    common = [
        f"data.train=[{demo_pairs}]",
        "logger.kind=none",
        "trainer.max_steps=6",
        "trainer.val_every_n_steps=6",
        "trainer.accelerator=cpu",
        "run.name=run",
    ]
    runs = {
        "single": ["loader.micro_batch_size=8"],
        "fsdp": ["trainer.strategy=fsdp", "trainer.devices=2", "loader.micro_batch_size=4"],
    }
    losses, accuracy, metadata = {}, {}, {}
    for name, extra in runs.items():
        out = tmp_path / name
        run_cli("rm", str(ROOT / "configs/rm/tiny.yaml"), f"run.out_dir={out}", *common, *extra)
        losses[name] = dict(read_metric(out / "run", "metrics.csv", "train/loss"))
        accuracy[name] = dict(read_metric(out / "run", "accuracy.csv", "val/accuracy"))
        metadata[name] = load_scalar_model(out / "run" / "final")[1]
    assert sorted(losses["single"]) == sorted(losses["fsdp"]) == list(range(1, 7))
    for step, loss in losses["single"].items():
        assert losses["fsdp"][step] == pytest.approx(loss, abs=1e-4), step
    assert accuracy["single"].keys() == accuracy["fsdp"].keys() == {6}
    assert accuracy["fsdp"][6] == pytest.approx(
        accuracy["single"][6], abs=1e-6
    )  # the same 20 val pairs, each counted once
    for key in ("reward_mean", "reward_std"):
        assert metadata["fsdp"][key] == pytest.approx(metadata["single"][key], rel=1e-3, abs=1e-3)
