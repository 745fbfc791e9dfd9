"""lm-eval tasks inside training (``eval.harness_*``): checked at load in every stage that has them, scored at each
validation and logged like the other validation numbers, kept as JSON and curves beside the run, without changing
what trains; a failure costs its numbers, not the run. Every stage in a pipeline run: tests/alignment/commands/
test_pipeline.py; two FSDP ranks: tests/alignment/test_sft.py."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="in-loop harness tasks need lm-eval (the eval extra)")

from alignment.schemas.dpo import DPOConfig
from alignment.schemas.pretrain import PretrainConfig
from alignment.schemas.rl import GRPOConfig, PPOConfig
from alignment.schemas.sft import SFTConfig
from data.demo.tasks import write_demo_dataset
from models.errors import ConfigError
from models.formats.checkpoint import load_checkpoint
from trainer.config import load_config
from trainer.harness import flat_metrics
from trainer.harness_validation import headline_metrics

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = {"sft": SFTConfig, "dpo": DPOConfig, "pretrain": PretrainConfig, "grpo": GRPOConfig, "ppo": PPOConfig}
TASKS = "eval.harness_tasks=[lantern_demo_choice,lantern_demo_passages,lantern_demo_answers]"


@pytest.mark.parametrize("stage", SCHEMAS)
def test_every_training_stage_takes_harness_tasks_checked_at_load(stage):
    config = load_config(SCHEMAS[stage], ROOT / f"configs/{stage}/tiny.yaml", [TASKS, "eval.harness_limit=5"])
    assert config.eval.harness_tasks == ["lantern_demo_choice", "lantern_demo_passages", "lantern_demo_answers"]
    assert config.eval.harness_limit == 5 and config.eval.harness_num_fewshot is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["eval.harness_tasks=[lantern_demo_choise]"], "eval.harness_tasks: unknown task 'lantern_demo_choise'; "),
        (
            ["eval.harness_tasks=[lantern_demo_choice]", "eval.harness_include_path=[/no/such/folder]"],
            "eval.harness_include_path /no/such/folder: no such folder",
        ),
        (
            ["eval.harness_tasks=[humaneval_local]"],
            "eval.harness_tasks: humaneval_local runs the generated code; set "
            "eval.harness_confirm_run_unsafe_code=true to allow it",
        ),
        (["eval.harness_tasks=[lantern_demo_choice]", "eval.harness_limit=0"], "eval.harness_limit must be >= 1"),
    ],
)
def test_bad_harness_settings_are_one_line_at_load(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(SFTConfig, ROOT / "configs/sft/tiny.yaml", overrides)
    assert message in str(error.value) and "\n" not in str(error.value)
    if "choise" in overrides[0]:
        assert "nearest: lantern_demo_choice" in str(error.value)


def test_flat_metrics_name_each_task_metric_and_its_standard_error():
    results = {
        "results": {
            "a": {"alias": "a", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": 0.25, "ppl,none": 3.0},
            "b": {"exact_match,strict-match": 1.0, "exact_match_stderr,strict-match": "N/A"},
            "c": {"word_perplexity,none": 9e5, "bits_per_byte,none": 3.5},
            "d": {"word_perplexity,none": 9e5},
        }
    }
    assert flat_metrics(results) == {
        "a/acc": 0.5, "a/acc_stderr": 0.25, "a/ppl": 3.0, "b/exact_match_strict-match": 1.0,
        "c/word_perplexity": 9e5, "c/bits_per_byte": 3.5, "d/word_perplexity": 9e5,
    }  # fmt: skip
    assert headline_metrics(results) == {
        "a/acc": 0.5, "b/exact_match_strict-match": 1.0, "c/bits_per_byte": 3.5, "d/word_perplexity": 9e5,
    }  # fmt: skip


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    return write_demo_dataset(tmp_path_factory.mktemp("demo"), n_train=200, n_val=16, n_pairs=10, seed=0)


def sft(demo, out: Path, *overrides: str) -> Path:
    from alignment.stages.sft import run_sft

    config = load_config(
        SFTConfig,
        ROOT / "configs/sft/tiny.yaml",
        [
            f"data.train=[{demo['train']}]", f"data.val=[{demo['val']}]", f"run.out_dir={out}", "logger.kind=csv",
            "trainer.max_steps=4", "trainer.val_every_n_steps=2", "eval.generations=2", "peft.kind=lora",
            "peft.dropout=0.2", *overrides,
        ],
    )  # fmt: skip
    return run_sft(config)


def logged(run_dir: Path, name: str) -> list[tuple[int, float]]:
    """(step, value) of ``name`` in the run's Lightning CSV log."""
    with open(run_dir / "csv" / "metrics.csv", newline="") as handle:
        return [(int(r["step"]), float(r[name])) for r in csv.DictReader(handle) if r.get(name)]


def test_harness_tasks_are_scored_at_each_validation_without_changing_what_trains(demo, tmp_path):
    """The three request types at steps 2 and 4, logged under val/harness/ and kept beside the run; the weights
    trained (LoRA dropout draws from the global RNG, which lm-eval reseeds) equal a run's without harness tasks."""
    plain = sft(demo, tmp_path / "plain")
    scored = sft(demo, tmp_path / "scored", TASKS, "eval.harness_limit=3")
    for name in ("lantern_demo_choice/acc", "lantern_demo_passages/bits_per_byte", "lantern_demo_answers/exact_match"):
        steps = [step for step, _ in logged(scored, f"val/harness/{name}")]
        assert len(steps) == 2 and steps[0] < steps[1], name  # Lightning's step column: one row per validation
    acc = logged(scored, "val/harness/lantern_demo_choice/acc")
    assert all(0.0 <= value <= 1.0 for _, value in acc)
    assert [p.name for p in sorted((scored / "harness").iterdir())] == ["step-0000002.json", "step-0000004.json"]
    record = json.loads((scored / "harness" / "step-0000004.json").read_text())
    assert record["step"] == 4 and record["n-samples"]["lantern_demo_choice"]["effective"] == 3
    assert record["results"]["lantern_demo_choice"]["acc,none"] == pytest.approx(acc[-1][1])  # logged as float32
    assert (scored / "harness.png").read_bytes()[:4] == b"\x89PNG"
    assert "lantern_demo_passages/bits_per_byte,2," in (scored / "harness.csv").read_text()
    assert not (plain / "harness").exists()
    # the last evaluation (step 4, the final weights) is what `lantern eval` gives the exported model
    from alignment.commands.cli import main

    tasks = "lantern_demo_choice,lantern_demo_passages,lantern_demo_answers"
    assert main(["eval", str(scored / "final"), "--tasks", tasks, "--limit", "3", "--out", str(tmp_path / "e")]) == 0
    standalone = json.loads(next((tmp_path / "e").glob("*/results_*.json")).read_text())["results"]
    for task, values in record["results"].items():
        for metric, value in values.items():
            if "," in metric and isinstance(value, float):  # LoRA merged on export: float32 rounding apart
                assert standalone[task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
    trained, reference = load_checkpoint(scored / "final").state_dict(), load_checkpoint(plain / "final").state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=0, msg=name)


def test_a_failing_harness_evaluation_costs_its_numbers_not_the_run(demo, tmp_path, monkeypatch, caplog):
    import trainer.harness_validation as harness_validation

    def fail(*args, **kwargs):
        raise RuntimeError("task exploded")

    monkeypatch.setattr(harness_validation, "evaluate", fail)
    run_dir = sft(demo, tmp_path, "eval.harness_tasks=[lantern_demo_choice]", "eval.harness_limit=2")
    assert (run_dir / "final" / "model.safetensors").is_file()
    failures = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert failures == [
        f"eval.harness_tasks at step {step} failed (RuntimeError: task exploded); training goes on" for step in (2, 4)
    ]
    record = json.loads((run_dir / "harness" / "step-0000002.json").read_text())
    assert record == {"step": 2, "error": "RuntimeError: task exploded"}
    assert not logged(run_dir, "val/harness/lantern_demo_choice/acc")
