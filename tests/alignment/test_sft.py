import csv
import json
import math
from pathlib import Path

import pytest
import torch

from alignment.schemas.sft import SFTConfig
from alignment.stages.sft import per_example_mean, sft_loss_contribution
from data.demo.tasks import write_demo_dataset
from models.formats.checkpoint import load_checkpoint
from tests.helpers import CaptureGradients, run_cli, run_lantern
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    return write_demo_dataset(tmp_path_factory.mktemp("demo"), n_train=300, n_val=40, n_pairs=10, seed=0)


def sft_config(demo, out_dir, *overrides) -> SFTConfig:
    return load_config(
        SFTConfig,
        ROOT / "configs/sft/tiny.yaml",
        [
            f"data.train=[{demo['train']}]",
            f"data.val=[{demo['val']}]",
            f"run.out_dir={out_dir}",
            "logger.kind=none",
            *overrides,
        ],
    )


def first_step_gradients(demo, out_dir, micro_batch, accumulate, reduction) -> dict[str, torch.Tensor]:
    from alignment.stages.sft import run_sft

    capture = CaptureGradients()
    config = sft_config(
        demo, out_dir,
        f"loader.micro_batch_size={micro_batch}", f"trainer.accumulate_grad_batches={accumulate}",
        f"loss.reduction={reduction}", "trainer.max_steps=1", "trainer.val_every_n_steps=1000", "optim.grad_clip=null",
    )  # fmt: skip
    run_sft(config, extra_callbacks=[capture])
    return capture.gradients


@pytest.mark.parametrize("reduction", ["token", "example"])
def test_gradient_accumulation_invariance(demo, tmp_path, reduction):
    """micro-batch 1 x accumulation 8 gives the same gradient as 8 x 1: normalised by the accumulated batch's
    supervised tokens (or examples), not a mean of per-micro-batch means."""
    one_by_eight = first_step_gradients(demo, tmp_path / "a", 1, 8, reduction)
    eight_by_one = first_step_gradients(demo, tmp_path / "b", 8, 1, reduction)
    assert one_by_eight.keys() == eight_by_one.keys() and one_by_eight
    for name in one_by_eight:
        torch.testing.assert_close(one_by_eight[name], eight_by_one[name], rtol=1e-4, atol=1e-7, msg=name)


def test_per_example_mean_ignores_packing():
    """Two examples packed in one row, or each in its own padded row: the same per-example means."""
    losses = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0, 0.0]])
    targets = torch.tensor([[5, 5, -100, 5, 5, -100]])
    packed_docs = torch.tensor([[0, 0, 0, 1, 1, 2]])
    packed = per_example_mean(losses, targets, packed_docs)
    padded_losses = torch.tensor([[1.0, 2.0, 3.0, 0.0], [10.0, 20.0, 0.0, 0.0]])
    padded_targets = torch.tensor([[5, 5, -100, -100], [5, 5, -100, -100]])
    padded = per_example_mean(padded_losses, padded_targets, torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1]]))
    assert packed.tolist() == padded.tolist() == [1.5, 15.0]
    token = sft_loss_contribution(
        losses, targets, packed_docs, reduction="token", step_tokens=torch.tensor(4.0), step_examples=torch.tensor(2.0)
    )
    example = sft_loss_contribution(
        losses,
        targets,
        packed_docs,
        reduction="example",
        step_tokens=torch.tensor(4.0),
        step_examples=torch.tensor(2.0),
    )
    assert token.item() == pytest.approx(33 / 4) and example.item() == pytest.approx(16.5 / 2)


def test_packed_and_unpacked_example_loss_are_equal_on_a_model(demo, tmp_path):
    """Validation's example-averaged loss of one model on the same examples, packed vs padded rows."""
    from alignment.shared.initial_model import load_initial_model
    from data.sft.datamodule import SFTDataModule

    config = sft_config(demo, tmp_path)
    model = load_initial_model(config).eval()
    results = []
    for packing in (True, False):
        data_config = sft_config(demo, tmp_path, f"data.packing={packing}").data
        datamodule = SFTDataModule(data_config, micro_batch_size=4)
        datamodule.setup("fit")
        means = []
        with torch.no_grad():
            for batch in datamodule.val_dataloader():
                losses = model.token_losses(batch["input_ids"], batch["targets"], document_ids=batch["document_ids"])
                means.append(per_example_mean(losses, batch["targets"], batch["document_ids"]))
        results.append(torch.cat(means))
    packed, padded = results
    assert packed.numel() == padded.numel() == 40
    torch.testing.assert_close(packed.sort().values, padded.sort().values, atol=1e-5, rtol=1e-5)


def read_metric(run_dir: Path, csv_name: str, metric: str) -> list[tuple[int, float]]:
    with open(run_dir / csv_name, newline="") as handle:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(handle) if r["metric"] == metric]


def test_tiny_sft_run_lowers_validation_loss_and_exports(demo, tmp_path):
    from alignment.stages.sft import run_sft

    run_dir = run_sft(
        sft_config(demo, tmp_path, "trainer.max_steps=30", "trainer.val_every_n_steps=15", "eval.generations=8")
    )
    val = read_metric(run_dir, "metrics.csv", "val/loss")
    assert [step for step, _ in val] == [15, 30]
    assert val[0][1] < math.log(4096)  # below the uniform guess after 15 steps
    assert val[-1][1] < val[0][1] - 0.15  # and still falling
    assert read_metric(run_dir, "accuracy.csv", "val/accuracy")  # exact match was measured
    assert (run_dir / "loss.png").stat().st_size > 1000 and (run_dir / "accuracy.png").stat().st_size > 1000
    assert (run_dir / "val_samples.jsonl").read_text().count("\n") >= 8
    model = load_checkpoint(run_dir / "final")
    assert model.config.dim == 128 and (run_dir / "final" / "tokenizer.model").is_file()


@pytest.mark.slow
def test_fsdp_sft_on_two_processes_matches_single_process(demo, tmp_path):
    """2-process FSDP2 SFT (bf16 + activation checkpointing) with generation and lm-eval tasks in validation (weights
    unsharded once for each; rank 0 scores the tasks while rank 1 waits), against a single process with the same
    global batch."""
    common = [
        f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]", "logger.kind=none", "trainer.max_steps=6",
        "trainer.val_every_n_steps=6", "eval.generations=8", "trainer.accelerator=cpu", "run.name=run",
        "eval.harness_tasks=[lantern_demo_choice,lantern_demo_answers]", "eval.harness_limit=4",
    ]  # fmt: skip
    runs = {
        "single": ["loader.micro_batch_size=4"],
        "fsdp": [
            "trainer.strategy=fsdp",
            "trainer.devices=2",
            "loader.micro_batch_size=2",
            "trainer.precision=bf16-mixed",
            "trainer.activation_checkpointing=full",
        ],
    }
    losses = {}
    for name, extra in runs.items():
        out = tmp_path / name
        run_cli("sft", str(ROOT / "configs/sft/tiny.yaml"), f"run.out_dir={out}", *common, *extra)
        losses[name] = dict(read_metric(out / "run", "metrics.csv", "train/loss"))
        assert read_metric(out / "run", "accuracy.csv", "val/accuracy")
        assert (out / "run" / "final" / "model.safetensors").is_file()
        harness = json.loads((out / "run" / "harness" / "step-0000006.json").read_text())["results"]
        assert (
            0.0 <= harness["lantern_demo_choice"]["acc,none"] <= 1.0
            and "exact_match,none" in harness["lantern_demo_answers"]
        )
    assert sorted(losses["single"]) == sorted(losses["fsdp"]) == list(range(1, 7))
    for step, loss in losses["single"].items():
        assert losses["fsdp"][step] == pytest.approx(loss, abs=3e-2), step


@pytest.mark.slow
def test_fsdp_validation_with_fewer_examples_than_ranks_does_not_hang(demo, tmp_path):
    """One validation example over 2 ranks: rank 1 generates nothing, yet must join the single weight gather
    (a gather per generate call left it out, and rank 0 waited forever)."""
    command = [
        "sft", str(ROOT / "configs/sft/tiny.yaml"), f"run.out_dir={tmp_path}",
        f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]", "logger.kind=none", "trainer.max_steps=2",
        "trainer.val_every_n_steps=2", "eval.generations=1", "trainer.accelerator=cpu", "run.name=run",
        "trainer.strategy=fsdp", "trainer.devices=2", "loader.micro_batch_size=2",
    ]  # fmt: skip
    result = run_lantern(*command, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_metric(tmp_path / "run", "accuracy.csv", "val/accuracy")
