"""``lantern eval``: lm-eval's tasks and metrics over Lantern checkpoints (a folder and a LoRA training checkpoint,
merged), results as lm-eval writes them plus a table, and one line for each bad input before the weights are read."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lantern eval needs lm-eval (the eval extra)")

from alignment.commands.cli import main
from data.demo.harness import write_harness_tasks
from data.tokenizer.tokenizer import Tokenizer
from models.adapters import add_adapters, base_fingerprint, trained_names
from models.formats.checkpoint import save_checkpoint
from models.model import ModelConfig, Transformer
from models.model_config import PeftConfig
from trainer.harness_tasks import pass_at_1

CONFIG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=128)
DEMO_TASKS = "lantern_demo_choice,lantern_demo_passages,lantern_demo_answers"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny native folder, a LoRA training checkpoint on it, and the demo tasks' folder."""
    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    base = Transformer(CONFIG)
    folder = save_checkpoint(base, root / "native", tokenizer_path=Tokenizer.load("default").path)
    peft = PeftConfig(kind="lora", rank=4, alpha=8)
    add_adapters(base, peft)
    record = {"checkpoint": str(folder.resolve()), "seed": None, "model": CONFIG.to_dict(),
              "fingerprint": base_fingerprint(base), "peft": asdict(peft)}  # fmt: skip
    checkpoint = {
        "hyper_parameters": {"config": {"model": CONFIG.to_dict(), "data": {"tokenizer": "default"}}},
        "state_dict": {f"model.{k}": v for k, v in base.state_dict().items() if k in trained_names(base)},
        "adapters": {"model": record},
        "global_step": 1,
    }
    torch.save(checkpoint, root / "lora.ckpt")
    return {"folder": folder, "ckpt": root / "lora.ckpt", "tasks": write_harness_tasks(root / "harness", n=6)}


def lantern_eval(*args: str) -> int:
    return main(["eval", *args])


@pytest.mark.parametrize("source", ["folder", "ckpt"])
def test_eval_writes_lm_evals_results_and_a_table(setup, tmp_path, source, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb = ["--wandb-project", "lantern-eval-test"] if source == "folder" else []
    code = lantern_eval(str(setup[source]), "--tasks", DEMO_TASKS, "--include-path", str(setup["tasks"]),
                        "--limit", "4", "--out", str(out), "--log-samples", *wandb)  # fmt: skip
    assert code == 0, capsys.readouterr().err
    (results_file,) = out.glob("*/results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert set(results) == set(DEMO_TASKS.split(","))
    assert 0.0 <= results["lantern_demo_choice"]["acc,none"] <= 1.0
    assert results["lantern_demo_choice"]["acc_stderr,none"] >= 0.0  # 0 where all 4 answers score alike
    assert results["lantern_demo_passages"]["word_perplexity,none"] > 1.0
    assert len(list(out.glob("*/samples_lantern_demo_answers_*.jsonl"))) == 1
    table = (out / "table.md").read_text()
    assert "lantern_demo_choice" in table and table in capsys.readouterr().out
    assert bool(list((out / "wandb").glob("offline-run-*"))) == bool(wandb)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "lantern_demo_choise"], "unknown task 'lantern_demo_choise'; nearest: lantern_demo_choice"),
        (["--tasks", "lantern_demo_choice", "--include-path", "/no/such/folder"], "--include-path /no/such/folder"),
        (["--tasks", "humaneval_local"], "set --confirm-run-unsafe-code to allow it"),
        (["--tasks", "lantern_demo_choice", "--tokenizer", "cl100k_base"], "tokenizer"),
    ],
)
def test_bad_input_is_one_line_before_the_weights_are_read(setup, tmp_path, args, message, capsys, monkeypatch):
    import models.formats.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("weights read"))
    if "--include-path" not in args:
        args = [*args, "--include-path", str(setup["tasks"])]
    assert lantern_eval(str(setup["folder"]), *args, "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_limit_zero_is_refused_by_the_parser(setup, capsys):
    with pytest.raises(SystemExit) as stop:
        lantern_eval(str(setup["folder"]), "--tasks", "lantern_demo_choice", "--limit", "0")
    assert stop.value.code == 2 and "--limit: must be > 0" in capsys.readouterr().err


def test_a_hub_task_without_network_names_the_task_and_local_files(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network, at once (the real failure retries for ~20 s)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert lantern_eval(str(setup["folder"]), "--tasks", "arc_easy", "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tasks arc_easy" in err and "--include-path" in err, err


def test_humaneval_pass_at_1_runs_the_tests_of_a_completion():
    reference = "def check(candidate):\n    assert candidate(2, 3) == 5\n\ncheck(add)"
    prompt = "def add(a, b):\n"
    assert pass_at_1([reference], [[prompt + "    return a + b\n"]]) == 1.0
    assert pass_at_1([reference], [[prompt + "    return a * b\n"]]) == 0.0


@pytest.mark.slow
def test_a_gguf_file_scores_as_its_converted_folder(smollm2, setup, tmp_path, capsys):
    """The real model's GGUF file read directly (weights dequantized, its own tokenizer rebuilt) gives the
    converted folder's per-request log-likelihoods."""
    logged = {}
    for name, checkpoint in (("gguf", smollm2.gguf), ("folder", smollm2.folder)):
        out = tmp_path / name
        code = lantern_eval(str(checkpoint), "--tasks", "lantern_demo_choice", "--include-path", str(setup["tasks"]),
                            "--limit", "3", "--out", str(out), "--log-samples")  # fmt: skip
        assert code == 0, capsys.readouterr().err
        (samples,) = out.glob("*/samples_lantern_demo_choice_*.jsonl")
        logged[name] = [json.loads(line)["resps"] for line in samples.read_text().splitlines()]
    assert len(logged["gguf"]) == 3
    for mine, reference in zip(logged["gguf"], logged["folder"], strict=True):
        for (a,), (b,) in zip(mine, reference, strict=True):
            assert float(a[0]) == pytest.approx(float(b[0]), abs=1e-4) and a[1] == b[1]
