"""Broken lm-evaluation-harness tasks given to `lantern eval`: a multiple-choice task whose `doc_to_target` names a
field the data lacks is one line naming the task, the document and the field, exit 2, with no table and before the
weights are read (before: every document scored wrong, 0 +- 0, and exit 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignment.commands.cli import main
from data.demo.harness import write_harness_tasks
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import save_checkpoint
from models.model import ModelConfig, Transformer

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=4096, max_seq_len=128))
    return save_checkpoint(model, tmp_path_factory.mktemp("eval") / "model", tokenizer_path=Tokenizer.load().path)


def test_a_target_outside_the_choices_is_one_line_naming_the_task_and_field(folder, tmp_path, capsys, monkeypatch):
    import models.formats.checkpoint as checkpoint

    tasks = write_harness_tasks(tmp_path / "tasks", n=6)
    (tasks / "lantern_demo_answers.yaml").unlink()  # only the broken task and its data stay
    (tasks / "lantern_demo_passages.yaml").unlink()
    yaml_file = tasks / "lantern_demo_choice.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("doc_to_target: label", "doc_to_target: labl"))
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("weights read"))
    out = tmp_path / "out"
    args = ["eval", str(folder), "--tasks", "lantern_demo_choice", "--include-path", str(tasks), "--out", str(out)]
    assert main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()[-1]  # after lm-eval's own progress bars
    assert err.startswith("lantern eval: error: --tasks lantern_demo_choice: document 1's target 'labl' is not one")
    assert "doc_to_target ('labl')" in err and "\n" not in err, err
    assert "|" not in captured.out  # no results table
    assert not [p for p in out.glob("*.json") if not p.name.startswith(".")]  # no results (the folder marker aside)


def test_a_full_disk_while_writing_samples_leaves_no_half_written_results(folder, tmp_path, capsys, monkeypatch):
    """Before: a 0-byte samples file and a results JSON stayed while the error said "nothing was written"."""
    import errno

    from lm_eval.loggers import EvaluationTracker

    def full_disk(self, task_name, samples):
        (self.output_path and Path(self.output_path) / f"samples_{task_name}.jsonl").write_text("")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(EvaluationTracker, "save_results_samples", full_disk, raising=True)
    out = tmp_path / "out"
    args = ["eval", str(folder), "--tasks", "lantern_demo_choice", "--limit", "4", "--log-samples", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after lm-eval's own progress bars
    assert err.startswith(f"lantern eval: error: cannot write evaluation results {out}: ") and "\n" not in err, err
    assert "the files it had begun are removed" in err
    assert not [p for p in out.rglob("*") if p.is_file() and p.name != ".lantern.json" and not p.name.startswith(".")]


def broken_task(tmp_path: Path, edit) -> Path:
    """The demo choice task alone in a folder, its YAML changed by ``edit`` (text -> text)."""
    tasks = write_harness_tasks(tmp_path / "tasks", n=6)
    (tasks / "lantern_demo_answers.yaml").unlink()
    (tasks / "lantern_demo_passages.yaml").unlink()
    yaml_file = tasks / "lantern_demo_choice.yaml"
    yaml_file.write_text(edit(yaml_file.read_text()))
    return tasks


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda t: t.replace("output_type: multiple_choice", "output_type: multi_choice"),
         "--tasks lantern_demo_choice: output_type 'multi_choice' is not one of lm-eval's: "),
        (lambda t: t.replace("lantern_demo_choice.jsonl", "gone.jsonl"),
         "--tasks lantern_demo_choice: its test data file "),
        (lambda t: t.replace("doc_to_choice: choices", "doc_to_choice: [choices"),
         "--include-path {tasks}: task file {tasks}/lantern_demo_choice.yaml cannot be read ("),
    ],
    ids=["output-type", "missing-data-file", "yaml-syntax"],
)  # fmt: skip
def test_a_broken_task_yaml_is_named_for_what_is_wrong(folder, tmp_path, capsys, edit, said):
    """Before: a bad output_type or a missing local file read as a Hub dataset needing network, and a YAML syntax
    error as "unknown task ... nearest: multiple_choice"."""
    tasks = broken_task(tmp_path, edit)
    out = tmp_path / "out"
    args = ["eval", str(folder), "--tasks", "lantern_demo_choice", "--include-path", str(tasks), "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lantern eval: error: " + said.format(tasks=tasks)) and "\n" not in err, err
    assert "Hub" not in err and "nearest" not in err, err
