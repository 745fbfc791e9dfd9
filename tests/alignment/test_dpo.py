"""DPO stage: which tokens are the response, one forward for both sides, the losses through the real module,
precomputed and on-the-fly reference log-probs, accumulation invariance, a short run that learns, exact resume,
config errors, and (slow) 2-process FSDP2 against a single process. Tiny models (dim 64, 2 layers)."""

import csv
import json
import math
import random
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from alignment.schemas.dpo import DPOConfig
from alignment.shared.losses import preference_loss
from alignment.stages.dpo import DPOModule, response_logprob_sums, run_dpo
from data.demo.tasks import write_demo_dataset
from data.preference.dpo import DPODataModule, answered_masks
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.generation import sequence_logprobs
from models.loss import IGNORE_INDEX
from models.model import ModelConfig, Transformer
from tests.helpers import CaptureGradients, run_cli, words, write_jsonl
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=256)
LOG2 = math.log(2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny SFT-like policy saved as SFT would, another model to serve as a different reference, the demo
    pairs (real data) and separable toy pairs (the chosen reply is always "yes", the rejected one "no")."""
    root = tmp_path_factory.mktemp("dpo")
    tokenizer = Tokenizer.load("default")
    torch.manual_seed(0)
    policy = save_checkpoint(Transformer(ModelConfig(**TINY)), root / "sft", tokenizer_path=tokenizer.path)
    other = save_checkpoint(Transformer(ModelConfig(**TINY)), root / "other", tokenizer_path=tokenizer.path)
    demo = write_demo_dataset(root / "demo", n_train=10, n_val=10, n_pairs=48, seed=0)["pairs"]
    rng = random.Random(0)
    toy = [{"prompt": words(rng, rng.randint(2, 8)), "chosen": "yes", "rejected": "no"} for _ in range(72)]
    return {
        "policy": policy,
        "other": other,
        "demo": demo,
        "toy": write_jsonl(root / "toy.jsonl", toy),
        "tokenizer": tokenizer,
    }


def dpo_config(setup, out_dir: Path, *overrides: str, pairs: str = "toy") -> DPOConfig:
    return load_config(
        DPOConfig,
        ROOT / "configs/dpo/tiny.yaml",
        [
            f"init.policy={setup['policy']}",
            f"data.train=[{setup[pairs]}]",
            f"run.out_dir={out_dir}",
            "logger.kind=none",
            "data.seq_len=192",
            "trainer.accelerator=cpu",  # fp32 everywhere: the comparisons below are to float rounding
            *overrides,
        ],
    )


def read_metric(run_dir: Path, csv_name: str, metric: str) -> dict[int, float]:
    with open(run_dir / csv_name, newline="") as handle:
        return {int(r["step"]): float(r["value"]) for r in csv.DictReader(handle) if r["metric"] == metric}


def run_metrics(run_dir: Path, accuracy: str) -> dict[str, dict[int, float]]:
    """A DPO run's losses, train reward margin and ``accuracy`` (train/ or val/reward_accuracy), by step."""
    return {
        metric: read_metric(run_dir, csv_name, metric)
        for csv_name, metric in [
            ("metrics.csv", "train/loss"),
            ("metrics.csv", "val/loss"),
            ("rewards.csv", "train/reward_margin"),
            ("accuracy.csv", accuracy),
        ]
    }


def eval_batch(config: DPOConfig, split: str = "train") -> dict[str, torch.Tensor]:
    datamodule = DPODataModule(config.data, micro_batch_size=config.loader.micro_batch_size)
    return datamodule.eval_batches(split)[0]


# ---- the response tokens ----


def test_the_response_is_the_reply_content_and_eot_only(setup, tmp_path):
    """Whatever the prompt holds (an earlier assistant turn, a prompt cut from the left) and however much the
    replies share, a side's response tokens are encode_chat's trained tokens of its reply; batches turn them
    into next-token targets."""
    tokenizer = setup["tokenizer"]
    records = [
        {"prompt": "What is two and three?", "chosen": "The answer is 5.", "rejected": "The answer is 6."},
        {
            "prompt": [
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Red."},
                {"role": "user", "content": "Another one?"},
            ],
            "chosen": "Blue.",
            "rejected": "Blue, and green.",
        },
        {"prompt": words(random.Random(1), 60), "chosen": "yes", "rejected": "no"},  # cut to fit seq_len 64
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    config = dpo_config(setup, tmp_path, "data.seq_len=64", "data.val_fraction=0", "loader.micro_batch_size=3")
    config.data.train = [str(path)]
    datamodule = DPODataModule(config.data, micro_batch_size=3)
    pairs = datamodule.eval_batches("train").pairs
    assert datamodule.stats["train"]["truncated"] == 1
    for index, record in enumerate(records):
        reply_masks = (pairs.reply_masks[0][index], pairs.reply_masks[1][index])
        masks = answered_masks(pairs.chosen[index], pairs.rejected[index], reply_masks)
        for side, mask, reply in zip(
            (pairs.chosen[index], pairs.rejected[index]), masks, (record["chosen"], record["rejected"])
        ):
            trained = tokenizer.encode_chat([{"role": "assistant", "content": reply}])[1][1:]  # after the BOS
            assert mask.tolist() == [False] * (len(side) - len(trained)) + trained, (index, reply)
    batch = datamodule.eval_batches("train")[0]
    assert batch["pair_index"].tolist() == [0, 1, 2] and batch["input_ids"].shape[0] == 6
    for row, reply in enumerate([r["chosen"] for r in records] + [r["rejected"] for r in records]):
        targets = batch["targets"][row]
        assert tokenizer.decode(targets[targets != IGNORE_INDEX].tolist()) == reply + "<|eot_id|>"


# ---- log-probs and losses through the real module ----


def test_one_forward_equals_two_and_the_shared_sequence_logprobs(setup, tmp_path):
    config = dpo_config(setup, tmp_path, pairs="demo")
    batch = eval_batch(config)
    model = load_checkpoint(setup["policy"]).eval()
    half = batch["input_ids"].shape[0] // 2
    with torch.no_grad():
        together, counts = response_logprob_sums(model, batch, chunk_size=64)
        parts = [
            response_logprob_sums(model, {k: batch[k][rows] for k in ("input_ids", "targets")}, chunk_size=None)[0]
            for rows in (slice(0, half), slice(half, None))
        ]
        shared = sequence_logprobs(model, batch["input_ids"])  # models/generation.py: full logits
    torch.testing.assert_close(together, torch.cat(parts), rtol=1e-5, atol=1e-4)
    scored = batch["targets"][:, :-1] != IGNORE_INDEX
    torch.testing.assert_close(together, (shared * scored).sum(-1), rtol=1e-5, atol=1e-4)
    assert (counts == scored.sum(-1)).all() and (counts > 0).all()


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo"])
def test_the_losses_through_the_module_on_real_pairs(setup, tmp_path, kind):
    """Policy = reference: DPO gives log 2 and IPO (0 - 1/(2 beta))^2 for every pair; SimPO and a different
    reference give preference_loss of the sums (DPO) or means (IPO, SimPO) of the response log-probs."""
    config = dpo_config(setup, tmp_path, f"loss.kind={kind}", "loss.reference_logprobs=on_the_fly", pairs="demo")
    batch = eval_batch(config)
    policy = load_checkpoint(setup["policy"])
    same = DPOModule(config, policy, None if kind == "simpo" else load_checkpoint(setup["policy"]), None)
    pairs = int(batch["pair_mask"].sum())
    with torch.no_grad():
        loss, sums = same.pair_terms(batch, "train")
        sums_policy, counts = response_logprob_sums(policy, batch, chunk_size=None)
    by_kind = {"dpo": LOG2, "ipo": (1 / (2 * config.loss.beta)) ** 2}
    if kind in by_kind:
        assert loss.item() == pytest.approx(pairs * by_kind[kind], rel=1e-6)
        assert sums[1].item() == 0 and sums[2].item() == 0  # no pair won, margins 0
    else:
        means = (sums_policy / counts).chunk(2)
        expected = -torch.nn.functional.logsigmoid(config.loss.beta * (means[0] - means[1]) - config.loss.simpo_gamma)
        assert loss.item() == pytest.approx(expected.sum().item(), rel=1e-5)
    if kind == "simpo":
        return
    other = DPOModule(config, load_checkpoint(setup["policy"]), load_checkpoint(setup["other"]), None)
    with torch.no_grad():
        loss_other = other.pair_terms(batch, "train")[0]
        reference, _ = response_logprob_sums(load_checkpoint(setup["other"]), batch, chunk_size=None)
    scale = counts if kind == "ipo" else torch.ones_like(counts)
    by_hand, _, _ = preference_loss(
        *(sums_policy / scale).chunk(2), *(reference / scale).chunk(2), kind=kind, beta=config.loss.beta
    )
    assert loss_other.item() == pytest.approx(by_hand.sum().item(), rel=1e-5)
    assert abs(loss_other.item() - loss.item()) > 1e-3


# ---- runs ----


def test_precomputed_and_on_the_fly_reference_give_the_same_losses(setup, tmp_path):
    """On the demo pairs, starting at log 2 (policy = reference at step 1): the same train and val numbers
    step by step; only the precomputed run writes its table beside the run."""
    common = [
        "trainer.max_steps=3",
        "trainer.val_every_n_steps=3",
        "run.name=run",
        "optim.lr=1e-3",
        "optim.min_lr=1e-3",
    ]
    runs = {}
    for mode in ("precompute", "on_the_fly"):
        run_dir = run_dpo(dpo_config(setup, tmp_path / mode, *common, f"loss.reference_logprobs={mode}", pairs="demo"))
        runs[mode] = run_metrics(run_dir, "val/reward_accuracy")
        assert len(list(run_dir.glob("reference-logprobs-*.pt"))) == (mode == "precompute")
    assert runs["precompute"]["train/loss"][1] == pytest.approx(LOG2, abs=1e-6)
    assert runs["on_the_fly"]["train/loss"][1] == pytest.approx(LOG2, abs=1e-6)
    for metric, values in runs["precompute"].items():
        assert values.keys() == runs["on_the_fly"][metric].keys() and values, metric
        for step, value in values.items():
            assert runs["on_the_fly"][metric][step] == pytest.approx(value, abs=1e-5), (metric, step)
    assert runs["precompute"]["train/reward_margin"][3] != 0.0


def first_step_gradients(setup, out_dir: Path, micro_batch: int, accumulate: int) -> dict[str, torch.Tensor]:
    capture = CaptureGradients()
    config = dpo_config(
        setup, out_dir, f"loader.micro_batch_size={micro_batch}", f"trainer.accumulate_grad_batches={accumulate}",
        "trainer.max_steps=1", "trainer.val_every_n_steps=1000", "optim.grad_clip=null", "loss.reference_logprobs=on_the_fly",
        "trainer.float32_matmul_precision=highest",
    )  # fmt: skip
    run_dpo(config, extra_callbacks=[capture])
    return capture.gradients


def test_gradient_accumulation_invariance(setup, tmp_path):
    """micro-batch 1 x accumulation 8 gives the gradient of 8 x 1: each pair's loss is divided by the pairs of
    the step, not averaged per micro-batch. Gradients, not weights: Adam's first step hides scale errors."""
    one_by_eight = first_step_gradients(setup, tmp_path / "a", 1, 8)
    eight_by_one = first_step_gradients(setup, tmp_path / "b", 8, 1)
    assert one_by_eight.keys() == eight_by_one.keys() and "output.weight" in one_by_eight
    for name, gradient in one_by_eight.items():
        atol = max(1e-5 * gradient.abs().max().item(), 1e-8)
        torch.testing.assert_close(gradient, eight_by_one[name], rtol=1e-4, atol=atol, msg=name)


def test_a_short_run_learns_the_preference_and_exports_the_policy(setup, tmp_path):
    common = ["trainer.max_steps=8", "trainer.val_every_n_steps=4", "optim.lr=1e-3", "optim.min_lr=1e-3"]
    run_dir = run_dpo(dpo_config(setup, tmp_path, *common))
    margin = read_metric(run_dir, "rewards.csv", "train/reward_margin")
    accuracy = read_metric(run_dir, "accuracy.csv", "train/reward_accuracy")
    assert abs(margin[1]) < 1e-6  # policy = reference (up to the precomputed table's rounding)
    assert margin[8] > margin[4] > margin[2] > 0 and accuracy[8] == 1.0
    assert read_metric(run_dir, "accuracy.csv", "val/reward_accuracy")[8] == 1.0
    assert read_metric(run_dir, "metrics.csv", "train/loss")[8] < 0.6
    assert all((run_dir / name).is_file() for name in ("loss.png", "accuracy.png", "rewards.png"))
    metadata = json.loads((run_dir / "final" / "lantern.json").read_text())["metadata"]
    assert metadata["stage"] == "dpo" and metadata["step"] == 8 and metadata["loss"] == "dpo"
    trained, initial = load_checkpoint(run_dir / "final"), load_checkpoint(setup["policy"])
    assert not torch.equal(trained.output.weight, initial.output.weight)


class Crash(Exception):
    pass


class CrashAfterTwo(L.Callback):
    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == 2:
            raise Crash  # step 2 is complete: AtomicCheckpoint saves it on the way out


def test_resume_is_exact_and_reuses_the_reference_table(setup, tmp_path, monkeypatch):
    common = ["trainer.max_steps=4", "checkpoint.every_n_steps=2", "trainer.val_every_n_steps=100"]
    straight = run_dpo(dpo_config(setup, tmp_path / "straight", *common))
    with pytest.raises(Crash):
        run_dpo(dpo_config(setup, tmp_path / "resumed", *common), extra_callbacks=[CrashAfterTwo()])

    def no_second_pass(self, split):
        raise AssertionError("the resumed run recomputed the reference log-probs")

    monkeypatch.setattr(DPOModule, "_score_split", no_second_pass)
    resumed = run_dpo(dpo_config(setup, tmp_path / "resumed", *common))
    a, b = load_file(straight / "final/model.safetensors"), load_file(resumed / "final/model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0, msg=name)
    losses = read_metric(resumed, "metrics.csv", "train/loss")
    assert losses == read_metric(straight, "metrics.csv", "train/loss") and sorted(losses) == [1, 2, 3, 4]


# ---- checks before compute ----


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.betta=0.2"], r"invalid config key 'loss\.betta'.*Did you mean: 'beta'"),
        (["loss.kind=kto"], r"loss\.kind"),
        (["loss.reference_logprobs=cached"], r"loss\.reference_logprobs"),
        (["loss.beta=0"], r"loss\.beta must be > 0"),
        (["loss.label_smoothing=0.5"], r"loss\.label_smoothing must be in \[0, 0\.5\)"),
        (["loss.kind=ipo", "loss.label_smoothing=0.1"], r"loss\.label_smoothing applies to dpo and simpo"),
        (["loss.simpo_gamma=-1"], r"loss\.simpo_gamma must be >= 0"),
        (["optim.lr=1e-6"], r"min_lr .* must be <= optim\.lr"),
        (["data.seq_len=512"], r"data\.seq_len \(512\) exceeds"),
    ],
)
def test_a_bad_setting_is_a_one_line_config_error_before_compute(setup, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        run_dpo(dpo_config(setup, tmp_path, *overrides))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "dpo-tiny").exists()


def test_a_reference_with_another_vocabulary_is_refused(setup, tmp_path):
    other = save_checkpoint(Transformer(ModelConfig(**{**TINY, "vocab_size": 5000})), tmp_path / "other")
    with pytest.raises(ConfigError, match="vocab_size 5000"):
        run_dpo(dpo_config(setup, tmp_path, f"init.reference={other}"))
    assert not (tmp_path / "dpo-tiny").exists()


def test_presets_load_and_the_cli_has_the_stage(capsys):
    tiny = load_config(DPOConfig, ROOT / "configs/dpo/tiny.yaml")
    assert tiny.init.policy is None and tiny.model.dim == 128 and tiny.loss.kind == "dpo"
    assert tiny.data.train == ["runs/data/demo/pairs.jsonl"] and tiny.optim.min_lr == tiny.optim.lr
    default = DPOConfig()
    assert (default.loss.beta, default.loss.reference_logprobs, default.optim.min_lr) == (0.1, "precompute", 5e-5)
    from alignment.commands.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "direct preference optimisation" in capsys.readouterr().out


# ---- distributed ----


@pytest.mark.slow
def test_fsdp_dpo_on_two_processes_matches_single_process(setup, tmp_path):
    """2-process FSDP2 (fp32, CPU, gloo) through the CLI against one process (in this one) with the same global
    batch of 8 pairs: the same pairs per step and the reference table scored half on each rank, so the losses
    agree to float rounding, from log 2 at step 1."""
    common = ["logger.kind=none", "trainer.max_steps=2", "trainer.val_every_n_steps=2", "trainer.accelerator=cpu"]
    fsdp = ["trainer.strategy=fsdp", "trainer.devices=2", "loader.micro_batch_size=4", "run.name=run"]
    overrides = [f"init.policy={setup['policy']}", f"data.train=[{setup['toy']}]", "data.seq_len=192", *common]
    run_cli("dpo", str(ROOT / "configs/dpo/tiny.yaml"), f"run.out_dir={tmp_path / 'fsdp'}", *overrides, *fsdp)
    single = run_dpo(dpo_config(setup, tmp_path / "single", *common, "loader.micro_batch_size=8"))
    runs = {"fsdp": tmp_path / "fsdp" / "run", "single": single}
    losses = {name: read_metric(run_dir, "metrics.csv", "train/loss") for name, run_dir in runs.items()}
    accuracy = {name: read_metric(run_dir, "accuracy.csv", "val/reward_accuracy") for name, run_dir in runs.items()}
    assert (runs["fsdp"] / "final" / "model.safetensors").is_file()
    assert len(list(runs["fsdp"].glob("reference-logprobs-*.pt"))) == 1
    assert sorted(losses["single"]) == sorted(losses["fsdp"]) == [1, 2]
    assert losses["fsdp"][1] == pytest.approx(LOG2, abs=1e-5)
    for step, loss in losses["single"].items():
        assert losses["fsdp"][step] == pytest.approx(loss, abs=1e-5), step
    assert accuracy["fsdp"].keys() == accuracy["single"].keys() == {2}
    assert accuracy["fsdp"][2] == pytest.approx(accuracy["single"][2], abs=1e-6)
