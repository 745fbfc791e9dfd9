"""A weighted mixture end to end on CPU: ``lantern prepare`` of two sources (the bundled corpus split in two files),
a tiny ``pretrain`` that logs ``val/NAME/loss`` per source, a resume with new weights, and a source prepared with
another tokenizer refused before compute."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from alignment.commands import cli
from alignment.schemas.pretrain import PretrainConfig
from alignment.stages.pretrain import run_pretrain
from data.pretrain.config import PrepareConfig
from data.pretrain.prepare import prepare
from tests.alignment.test_pretrain_run import CORPUS, assert_no_compute, read_metrics
from tests.data.pretrain.test_prepare import write_byte_tokenizer
from trainer.config import load_config


def weights(plays: float, sonnets: float) -> str:
    return (
        f"data.sources=[{{name: plays, source: [plays.txt], weight: {plays}}}, "
        f"{{name: sonnets, source: [sonnets.txt], weight: {sonnets}}}]"
    )


@pytest.fixture
def mixture_yaml(tmp_path: Path) -> Path:
    paragraphs = CORPUS.read_text(encoding="utf-8").split("\n\n")
    (tmp_path / "plays.txt").write_text("\n\n".join(paragraphs[:400]), encoding="utf-8")
    (tmp_path / "sonnets.txt").write_text("\n\n".join(paragraphs[-200:]), encoding="utf-8")
    path = tmp_path / "mixture.yaml"
    path.write_text(
        f"""run: {{name: mixture, out_dir: {tmp_path / "runs"}}}
model: tiny
data:
  source: []
  out_dir: {tmp_path / "data"}
  num_proc: 1
  sources:
    - {{name: plays, source: [{tmp_path / "plays.txt"}], weight: 0.7}}
    - {{name: sonnets, source: [{tmp_path / "sonnets.txt"}], weight: 0.3}}
loader: {{seq_len: 32, micro_batch_size: 4, val_batches: 2}}
optim: {{lr: 1.0e-3, min_lr: 1.0e-4, warmup_steps: 1}}
trainer: {{max_steps: 4, val_every_n_steps: 2, log_every_n_steps: 1}}
checkpoint: {{every_n_steps: 2, keep_last: 2}}
logger: {{kind: csv}}
""",
        encoding="utf-8",
    )
    return path


def test_prepare_then_pretrain_a_two_source_mixture(mixture_yaml, tmp_path, capsys, caplog):
    assert cli.main(["prepare", str(mixture_yaml)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"prepared {tmp_path / 'data'} (train: " in printed and "  plays: train: " in printed
    assert "  sonnets: train: " in printed

    run_dir = run_pretrain(load_config(PretrainConfig, mixture_yaml))
    metrics = read_metrics(run_dir)
    for name in ("val/loss", "val/plays/loss", "val/sonnets/loss"):
        assert [step for step, _ in metrics[name]] == [2, 4], (name, metrics)
    for (_, plays), (_, sonnets), (_, overall) in zip(
        metrics["val/plays/loss"], metrics["val/sonnets/loss"], metrics["val/loss"]
    ):
        assert plays != sonnets and math.isclose(overall, 0.7 * plays + 0.3 * sonnets, rel_tol=1e-5)
    logged = (run_dir / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")  # what W&B gets too
    assert {"val/plays/loss", "val/sonnets/loss", "val/plays/perplexity"} <= set(logged)

    # the next phase: other weights, same sources, continued from the same step
    resumed = load_config(PretrainConfig, mixture_yaml, [weights(1, 1), "trainer.max_steps=6"])
    with caplog.at_level(logging.INFO, logger="lantern.data"):
        run_pretrain(resumed)
    lines = [r.getMessage() for r in caplog.records if "weights changed" in r.getMessage()]
    assert lines == [
        "data weights changed on resume: plays 0.7→0.5, sonnets 0.3→0.5; continuing at step 4 (16 samples in)"
    ]
    assert [step for step, _ in read_metrics(run_dir)["val/sonnets/loss"]] == [2, 4, 6]


def test_a_source_prepared_with_another_tokenizer_is_refused_before_compute(mixture_yaml, tmp_path):
    config = load_config(PretrainConfig, mixture_yaml)
    assert cli.main(["prepare", str(mixture_yaml)]) == 0
    other = write_byte_tokenizer(tmp_path / "bytes.tiktoken")
    prepare(PrepareConfig(source=[str(tmp_path / "sonnets.txt")], tokenizer=str(other), num_proc=1,
                          out_dir=str(tmp_path / "data" / "sonnets")))  # fmt: skip
    with pytest.raises(ValueError, match=r"^data\.sources\[1\] \(sonnets\): the data in .* was tokenized by"):
        run_pretrain(config)
    assert_no_compute(tmp_path / "runs" / "mixture")
