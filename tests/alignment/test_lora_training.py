"""Training with LoRA adapters (``peft.kind=lora``): only the adapters (and a reward model's head) change and are
checkpointed, the export is the merged plain model, a resume is exact, a checkpoint is refused on another base or
without its adapters, and (slow) 2-process FSDP2 with bf16, activation checkpointing and torch.compile matches a
single process and resumes its sharded, adapters-only checkpoint exactly."""

from __future__ import annotations

import csv
import random
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch

from alignment.schemas.reward import RMConfig
from alignment.stages.reward import run_rm
from alignment.stages.sft import run_sft
from data.demo.tasks import write_demo_dataset
from models.errors import CheckpointError
from models.formats.checkpoint import load_checkpoint
from models.heads import load_scalar_model
from models.model import Transformer
from tests.alignment.test_sft import sft_config
from tests.helpers import run_cli, run_lantern, words, write_jsonl
from trainer.callbacks import full_state_dict
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
LORA = ["peft.kind=lora", "peft.rank=4", "peft.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=1"]
QUIET = ["trainer.val_every_n_steps=1000", "eval.generations=0", "checkpoint.keep_last=5"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    return write_demo_dataset(tmp_path_factory.mktemp("demo"), n_train=300, n_val=40, n_pairs=10, seed=0)


def lora_sft(demo, out_dir, *overrides):
    return sft_config(demo, out_dir, *LORA, *QUIET, *overrides)


def read_metric(run_dir: Path, metric: str, csv_name: str = "metrics.csv") -> dict[int, float]:
    with open(run_dir / csv_name, newline="") as handle:
        return {int(r["step"]): float(r["value"]) for r in csv.DictReader(handle) if r["metric"] == metric}


def checkpoint(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}.ckpt", map_location="cpu", weights_only=True)


class Crash(Exception):
    pass


class CrashAt(L.Callback):
    """Stops the run right after the checkpoint of ``step`` is written (extra callbacks run after the stage's)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise Crash


class Record(L.Callback):
    """The model's whole state (gathered) when training starts and ends, and how many batches trained."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.end: dict[str, torch.Tensor] = {}
        self.batches = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = {name: t.clone() for name, t in full_state_dict(pl_module.model, trainer).items()}

    def on_train_batch_start(self, trainer, *args) -> None:
        self.batches += 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.end = {name: t.clone() for name, t in full_state_dict(pl_module.model, trainer).items()}


def test_lora_sft_trains_only_the_adapters_and_exports_the_merged_model(demo, tmp_path):
    record = Record()
    config = lora_sft(demo, tmp_path, "trainer.max_steps=8", "checkpoint.every_n_steps=8")
    run_dir = run_sft(config, extra_callbacks=[record])

    losses = read_metric(run_dir, "train/loss")
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.1, losses  # the adapters learn

    # the checkpoint holds the adapters only, and the base it belongs to
    saved = checkpoint(run_dir, 8)
    adapters = saved["state_dict"]
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert len(adapters) == 2 * 7 * config.model.n_layers
    record_ = saved["adapters"]["model"]
    assert record_["checkpoint"] is None and record_["seed"] == config.run.seed and record_["peft"]["rank"] == 4

    # the base never moved: every one of its tensors, bit for bit, is the seeded initial model's
    torch.manual_seed(config.run.seed)
    initial = Transformer(config.model).state_dict()
    base_end = {name.replace(".base_layer.", "."): t for name, t in record.end.items() if "lora_" not in name}
    assert base_end.keys() == initial.keys()
    for name, tensor in initial.items():
        assert torch.equal(base_end[name], tensor), name
    changed = [
        name
        for name in adapters
        if not torch.equal(record.start[name.removeprefix("model.")], record.end[name.removeprefix("model.")])
    ]
    assert len(changed) == len(adapters)  # every adapter trained (lora_B starts at zero, lora_A moves after it)

    # final/ is a plain model: the base plus each adapter's scaled product, nothing else changed
    final = load_checkpoint(run_dir / "final")
    assert type(final) is Transformer
    exported = final.state_dict()
    assert exported.keys() == initial.keys()
    scale = config.peft.alpha / config.peft.rank
    for name, tensor in initial.items():
        prefix = f"model.{name.removesuffix('.weight')}"
        if f"{prefix}.lora_A.default.weight" in adapters:
            delta = scale * adapters[f"{prefix}.lora_B.default.weight"] @ adapters[f"{prefix}.lora_A.default.weight"]
            torch.testing.assert_close(exported[name], tensor + delta, rtol=0, atol=1e-6, msg=name)
            assert delta.abs().max() > 0, name
        else:
            assert torch.equal(exported[name], tensor), name


def test_lora_sft_resumes_exactly(demo, tmp_path):
    """6 steps straight vs 3, a crash and a resume for the last 3: the same losses and the same adapters; the
    optimizer's moments and the data position restored, and, with LoRA's dropout, the RNG state (validation at the
    checkpoint's step, which the resumed run does not repeat, leaves it alone)."""
    common = ["trainer.max_steps=6", "checkpoint.every_n_steps=3", "peft.dropout=0.1", "trainer.val_every_n_steps=3"]
    straight = run_sft(lora_sft(demo, tmp_path / "straight", *common))
    with pytest.raises(Crash):
        run_sft(lora_sft(demo, tmp_path / "resumed", *common), extra_callbacks=[CrashAt(3)])
    middle = checkpoint(tmp_path / "resumed/sft-tiny", 3)
    assert all("lora_" in name for name in middle["state_dict"])
    record = Record()
    resumed = run_sft(lora_sft(demo, tmp_path / "resumed", *common), extra_callbacks=[record])
    assert record.batches == 3  # steps 4 to 6 only
    a, b = read_metric(straight, "train/loss"), read_metric(resumed, "train/loss")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    end_a, end_b = checkpoint(straight, 6), checkpoint(resumed, 6)
    assert end_a["state_dict"].keys() == end_b["state_dict"].keys()
    for name, tensor in end_a["state_dict"].items():
        torch.testing.assert_close(end_b["state_dict"][name], tensor, rtol=0, atol=1e-6, msg=name)
    moments_a, moments_b = end_a["optimizer_states"][0]["state"], end_b["optimizer_states"][0]["state"]
    assert moments_a.keys() == moments_b.keys() and len(moments_a) == len(end_a["state_dict"])
    for index, state in moments_a.items():
        torch.testing.assert_close(moments_b[index]["exp_avg_sq"], state["exp_avg_sq"], rtol=0, atol=1e-9)


@pytest.fixture(scope="module")
def lora_run(demo, tmp_path_factory) -> Path:
    """A finished 2-step LoRA SFT run (its checkpoint at step 2) on a seeded base."""
    out = tmp_path_factory.mktemp("lora-run")
    run_sft(lora_sft(demo, out, "trainer.max_steps=2", "checkpoint.every_n_steps=2"))
    return out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "run.seed=7",
            r"adapters \(model\) were trained on the model seeded with run.seed=\d+ \(fingerprint \w+\), "
            r"this run's base is the model seeded with run.seed=7",
        ),
        (
            "init.checkpoint=FINAL",
            r"adapters \(model\) were trained on the model seeded with run.seed=\d+ .* "
            r"this run's base is /.*/final \(fingerprint",
        ),
        ("peft.kind=none", r"holds LoRA adapters but this run has peft.kind=none"),
        ("peft.rank=8", r"its adapters \(model\) are peft .*'rank': 4.* this run's section is .*'rank': 8"),
    ],
    ids=["another-seed", "another-folder", "no-adapters", "another-rank"],
)
def test_resuming_onto_another_base_or_without_the_adapters_is_refused(lora_run, demo, tmp_path, override, message):
    """Resuming the LoRA checkpoint with another base (another seed, another folder), without adapters or with
    other ones: one line naming the checkpoint, before any training step."""
    out = tmp_path / "out"
    shutil.copytree(lora_run, out)
    (out / "sft-tiny" / "final").rename(tmp_path / "final")  # another base: the merged model of the same run
    record = Record()
    override = override.replace("FINAL", str(tmp_path / "final"))
    config = lora_sft(demo, out, "trainer.max_steps=4", "checkpoint.every_n_steps=2", override)
    with pytest.raises(CheckpointError, match=message) as caught:
        run_sft(config, extra_callbacks=[record])
    assert str(out / "sft-tiny/checkpoints/step-00000002.ckpt") in str(caught.value)
    assert "\n" not in str(caught.value)
    assert record.batches == 0


def test_the_same_targets_spelled_otherwise_resume(lora_run, demo, tmp_path):
    """Targets by Hugging Face's names, in another order: the same adapters, so the checkpoint resumes."""
    shutil.copytree(lora_run, tmp_path / "out")
    record = Record()
    targets = "peft.target_modules=[up_proj,down_proj,gate_proj,wo,wv,wk,q_proj]"
    config = lora_sft(demo, tmp_path / "out", "trainer.max_steps=3", "checkpoint.every_n_steps=3", targets)
    run_sft(config, extra_callbacks=[record])
    assert record.batches == 1 and sorted(read_metric(tmp_path / "out/sft-tiny", "train/loss")) == [1, 2, 3]


def test_resuming_a_fully_trained_checkpoint_with_adapters_is_refused(demo, tmp_path):
    run_sft(sft_config(demo, tmp_path, *QUIET, "trainer.max_steps=1", "checkpoint.every_n_steps=1"))
    record = Record()
    with pytest.raises(CheckpointError, match="holds a fully trained model but this run adds adapters") as caught:
        run_sft(lora_sft(demo, tmp_path, "trainer.max_steps=2", "checkpoint.every_n_steps=1"), extra_callbacks=[record])
    assert "step-00000001.ckpt" in str(caught.value) and "\n" not in str(caught.value)
    assert record.batches == 0


@pytest.fixture(scope="module")
def toy_pairs(tmp_path_factory) -> Path:
    rng = random.Random(0)
    records = [{"prompt": words(rng, rng.randint(2, 12)), "chosen": "yes", "rejected": "no"} for _ in range(64)]
    return write_jsonl(tmp_path_factory.mktemp("toy") / "toy.jsonl", records)


def test_lora_reward_model_trains_its_head_and_the_adapters(toy_pairs, tmp_path):
    config = load_config(
        RMConfig,
        ROOT / "configs/rm/tiny.yaml",
        [
            f"data.train=[{toy_pairs}]", f"run.out_dir={tmp_path}", "logger.kind=none", *LORA,
            "trainer.max_steps=3", "trainer.val_every_n_steps=1000", "checkpoint.every_n_steps=3",
            "loss.normalization_pairs=16",
        ],
    )  # fmt: skip
    record = Record()
    run_dir = run_rm(config, extra_callbacks=[record])
    saved = checkpoint(run_dir, 3)["state_dict"]
    heads = {name for name in saved if name.startswith("model.head.")}
    assert heads and all("lora_" in name for name in set(saved) - heads)
    assert any("lora_" in name for name in saved)
    # The score head's weight trained. Its bias cannot: a Bradley-Terry loss reads only the difference of two rewards,
    # so the bias's gradient is zero up to rounding, and whether Adam (which scales any gradient, however small, to a
    # full step) moves it depends on the order of a float sum (the BLAS build, the thread count): at most lr a step.
    for name in heads:
        moved = (record.start[name.removeprefix("model.")] - saved[name]).abs().max().item()
        if name.endswith("bias"):
            assert moved <= config.trainer.max_steps * config.optim.lr * 1.01, name
        else:
            assert moved > 0, name
    assert any(name.endswith("weight") for name in heads)
    for name, tensor in record.end.items():  # the backbone's own weights did not
        if name.startswith("backbone.") and "lora_" not in name:
            assert torch.equal(tensor, record.start[name]), name
    model, _ = load_scalar_model(run_dir / "final")  # merged: a plain backbone and the trained head
    assert not any("lora_" in name or "base_layer" in name for name in model.state_dict())
    for name in heads:
        assert torch.equal(model.state_dict()[name.removeprefix("model.")], saved[name]), name


@pytest.mark.slow
def test_fsdp_lora_sft_matches_single_process_and_resumes_exactly(demo, tmp_path):
    """2-process FSDP2 (gloo) LoRA SFT with bf16-mixed, full activation checkpointing and torch.compile against one
    process with the same global batch; its sharded checkpoint holds the adapters (and their optimizer state) only;
    resumed from the middle checkpoint in another run folder, it continues with the uninterrupted run's losses."""
    import torch.distributed.checkpoint as dcp

    common = [
        str(ROOT / "configs/sft/tiny.yaml"), f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]",
        "logger.kind=none", "trainer.max_steps=6", "checkpoint.every_n_steps=3", "trainer.accelerator=cpu",
        "run.name=run", *LORA, *QUIET,
    ]  # fmt: skip
    fsdp = [
        "trainer.strategy=fsdp", "trainer.devices=2", "loader.micro_batch_size=2", "trainer.precision=bf16-mixed",
        "trainer.activation_checkpointing=full", "trainer.compile=true",
    ]  # fmt: skip
    run_cli("sft", *common, f"run.out_dir={tmp_path / 'single'}", "loader.micro_batch_size=4")
    run_cli("sft", *common, f"run.out_dir={tmp_path / 'fsdp'}", *fsdp)
    single, sharded = (
        read_metric(tmp_path / "single/run", "train/loss"),
        read_metric(tmp_path / "fsdp/run", "train/loss"),
    )
    assert sorted(single) == sorted(sharded) == list(range(1, 7))
    for step, loss in single.items():
        assert sharded[step] == pytest.approx(loss, abs=5e-3), step  # bf16: measured 6e-4
    assert sharded[6] < sharded[1]

    middle = tmp_path / "fsdp/run/checkpoints/step-00000003.ckpt"
    names = dcp.FileSystemReader(middle).read_metadata().state_dict_metadata.keys()
    weights = [name for name in names if name.startswith("state_dict.")]
    assert weights and all("lora_" in name for name in weights)
    assert len(weights) == 2 * 7 * 4  # every target of the tiny model's 4 blocks, A and B
    moments = {name.rsplit(".", 1)[0] for name in names if name.startswith("optimizer_0.state.")}
    assert moments and all("lora_" in name for name in moments)
    assert (tmp_path / "fsdp/run/final/model.safetensors").is_file()

    # without its adapters, or a single process's LoRA checkpoint: one line naming it, before Lightning or DCP looks
    # for the base's tensors in it
    single_file = tmp_path / "single/run/checkpoints/step-00000003.ckpt"
    for checkpoint_, override, message in [
        (middle, "peft.kind=none", "holds LoRA adapters but this run has peft.kind=none"),
        (single_file, "peft.kind=lora", "holds LoRA adapters trained by a single process: resume it with"),
    ]:
        refused = run_lantern(
            "sft", *common, f"run.out_dir={tmp_path / 'refused'}", "trainer.strategy=fsdp", "trainer.devices=2",
            "loader.micro_batch_size=2", override, f"checkpoint.resume={checkpoint_}", timeout=300,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert f"error: {checkpoint_} {message}" in refused.stderr

    run_cli("sft", *common, f"run.out_dir={tmp_path / 'resumed'}", *fsdp, f"checkpoint.resume={middle}")
    resumed = read_metric(tmp_path / "resumed/run", "train/loss")
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(sharded[step], abs=1e-6), step
    a = load_checkpoint(tmp_path / "fsdp/run/final").state_dict()
    b = load_checkpoint(tmp_path / "resumed/run/final").state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
