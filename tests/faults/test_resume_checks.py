"""What a run folder resumes must be this stage's run, of this model, and a training checkpoint at all; each is
checked before training starts, in one line, and nothing in the folder is rewritten by a refused resume.

- another model (a ``tiny`` run resumed with ``model=small``): one line naming both, config.yaml untouched;
- another stage (``lantern sft`` into a pretrain run's folder): one line naming both stages;
- a checkpoint that passes its checksum manifest but does not load (a pickle of Python objects), or a
  ``checkpoint.resume=`` that is a model's weights or a pickle: the right cause, never torch's advice to load it
  with ``weights_only=False``; auto-resume falls back to the older checkpoint that loads.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

import pytest
import torch

from alignment.commands.cli import main as lantern
from alignment.stages.pretrain import PretrainModule, run_pretrain
from alignment.stages.sft import run_sft
from data.demo.tasks import write_demo_dataset
from models.errors import CheckpointError, ConfigError, DataError
from models.files.folders import FolderNotLanterns
from tests.alignment.test_pretrain_run import RUN_NAME, tiny_config
from tests.alignment.test_sft import sft_config
from trainer.checkpoints import write_manifest

QUICK = ("trainer.max_steps=4", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=2", "logger.kind=none")


@pytest.fixture(scope="module")
def pretrained(data_dir, tmp_path_factory) -> Path:
    """A 4-step tiny pretraining run with checkpoints at steps 2 and 4 (copied by the tests that change it)."""
    runs = tmp_path_factory.mktemp("runs")
    run_pretrain(tiny_config(data_dir, runs, *QUICK))
    return runs


def copy_runs(pretrained: Path, tmp_path: Path) -> Path:
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(pretrained, runs)
    return runs


def test_resuming_with_another_model_is_one_line_and_rewrites_nothing(data_dir, pretrained, tmp_path):
    """Before: a ~70-line size-mismatch traceback, after config.yaml had been rewritten to the new model."""
    runs = copy_runs(pretrained, tmp_path)
    config_yaml = runs / RUN_NAME / "config.yaml"
    before = config_yaml.read_text()
    with pytest.raises(ConfigError) as caught:
        run_pretrain(tiny_config(data_dir, runs, *QUICK, "trainer.max_steps=6", "model=small"))
    message = str(caught.value)
    assert message.startswith(f"model: {runs / RUN_NAME} holds checkpoints of another model (dim 128")
    assert "than the config's (dim 512" in message and "\n" not in message
    assert config_yaml.read_text() == before


def test_resuming_with_the_same_tensors_computed_otherwise_is_refused(data_dir, pretrained, tmp_path):
    """Gemma's tanh-GELU gate over the same weights is another model: named, not resumed."""
    runs = copy_runs(pretrained, tmp_path)
    with pytest.raises(ConfigError) as caught:
        run_pretrain(tiny_config(data_dir, runs, *QUICK, "trainer.max_steps=6", "model.activation=gelu_tanh"))
    message = str(caught.value)
    assert "holds checkpoints of another model (activation silu) than the config's (activation gelu_tanh)" in message


def test_an_explicit_resume_of_another_models_checkpoint_is_one_line(data_dir, pretrained, tmp_path):
    checkpoint = pretrained / RUN_NAME / "checkpoints" / "step-00000004.ckpt"
    overrides = (*QUICK, "model=small", "run.name=other", f"checkpoint.resume={checkpoint}")
    with pytest.raises(ConfigError, match=rf"^checkpoint\.resume: {checkpoint} is a checkpoint of another model \(dim"):
        run_pretrain(tiny_config(data_dir, tmp_path / "runs", *overrides))


def test_loading_tensors_of_other_shapes_names_them_in_one_line(data_dir, tmp_path):
    """The last guard, for checkpoints that record no model (the module's own load_state_dict)."""
    module = PretrainModule(tiny_config(data_dir, tmp_path, *QUICK))
    state = {name: torch.zeros(3, 3) for name in module.state_dict()}
    with pytest.raises(CheckpointError, match=r"^the checkpoint being resumed holds another model \(\d+ tensors"):
        module.load_state_dict(state)


def test_another_stage_in_a_run_folder_is_refused_naming_both(pretrained, tmp_path):
    """Before: `lantern sft run.name=<a pretrain run>` tried to resume the pretrain checkpoint and failed with a
    misleading data-stream message."""
    demo = write_demo_dataset(tmp_path / "demo", n_train=40, n_val=8, n_pairs=4)
    runs = copy_runs(pretrained, tmp_path)
    stats = (runs / RUN_NAME / "data_stats.json").read_bytes()  # the pretrain run's own record
    with pytest.raises(FolderNotLanterns, match=rf"^run\.name: {runs / RUN_NAME} holds a pretrain run, not a sft run"):
        run_sft(sft_config(demo, runs, f"run.name={RUN_NAME}", "trainer.max_steps=2"))
    assert (runs / RUN_NAME / "data_stats.json").read_bytes() == stats  # not replaced by SFT's


def pickle_of_objects(path: Path) -> Path:
    """A torch file that holds a Python object besides tensors, in torch's old (non-zip) format, as Meta's
    ``consolidated.00.pth`` and many ``pytorch_model.bin`` files are."""
    torch.save(
        {"state_dict": {"w": torch.zeros(2)}, "args": argparse.Namespace(lr=1)},
        path,
        _use_new_zipfile_serialization=False,
    )
    return path


def test_a_checkpoint_that_passes_its_manifest_but_does_not_load_falls_back(data_dir, pretrained, tmp_path, caplog):
    """Before: a traceback, and auto-resume never tried the older verified checkpoint."""
    runs = copy_runs(pretrained, tmp_path)
    newest = runs / RUN_NAME / "checkpoints" / "step-00000004.ckpt"
    pickle_of_objects(newest)
    write_manifest(newest, newest, 4)  # its checksum matches: only loading it can tell
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="trainer.build"):
        warnings.simplefilter("always")
        run_pretrain(tiny_config(data_dir, runs, *QUICK, "trainer.max_steps=6"))
    skipped = [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]
    assert len(skipped) == 1 and str(newest) in skipped[0] and "pickle of Python objects" in skipped[0], skipped
    assert "weights_only" not in skipped[0]
    assert f"resuming from {newest.with_name('step-00000002.ckpt')}" in caplog.text


@pytest.mark.parametrize("kind", ["pickled", "model-weights"])
def test_an_explicit_resume_that_is_not_a_training_checkpoint_says_why(data_dir, tmp_path, capsys, kind):
    """Before: a pickled Hugging Face, Meta or export file was called "truncated or corrupt", with torch's advice
    that weights_only=False "will likely succeed"."""
    if kind == "pickled":
        path = pickle_of_objects(tmp_path / "consolidated.00.pth")
        cause = "refused: the file is a pickle of Python objects, not only tensors (it references argparse.Namespace)"
    else:
        path = tmp_path / "pytorch_model.bin"
        torch.save({"model.embed_tokens.weight": torch.zeros(4, 2)}, path)
        cause = "holds model weights, not a training checkpoint"
    config = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "tiny.yaml"
    status = lantern(
        ["pretrain", str(config), f"data.out_dir={data_dir}", f"run.out_dir={tmp_path / 'runs'}", *QUICK,
         f"checkpoint.resume={path}"]
    )  # fmt: skip
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2
    assert error.startswith(f"lantern pretrain: error: checkpoint.resume: {path}") and cause in error, error
    assert "weights_only" not in error and "truncated or corrupt" not in error


def test_a_resumed_run_trains_at_its_own_optimizer_settings_not_the_checkpoints(data_dir, tmp_path, caplog):
    """Before: a run resumed with `optim.lr=1e-5 optim.min_lr=1e-6` kept training at the checkpoint's 1e-3
    schedule (Lightning restores the param groups' lr and the scheduler's base rates), while config.yaml said 1e-5,
    so lowering the lr after a divergence, as Lantern advises, could not work. Now the new schedule continues from
    the checkpoint's step, Adam's moments kept, and the change is logged."""
    from trainer.optim_config import scheduled_lr

    first = ("trainer.max_steps=2", "checkpoint.every_n_steps=2", "optim.lr=1e-3", "optim.warmup_steps=0")
    run_pretrain(tiny_config(data_dir, tmp_path, *QUICK[1:], *first))
    again = (
        "trainer.max_steps=4",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=5",
        "optim.lr=1e-5",
        "optim.min_lr=1e-6",
    )
    config = tiny_config(data_dir, tmp_path, *QUICK[1:], "optim.warmup_steps=0", *again)
    caplog.set_level(logging.WARNING, logger="trainer.optim")
    run_dir = run_pretrain(config)
    assert "resumed with this config's optimizer settings, not the checkpoint's: lr 0.001 -> 1e-05" in caplog.text

    def saved(step: int) -> dict:
        path = run_dir / "checkpoints" / f"step-{step:08d}.ckpt"
        return torch.load(path, map_location="cpu", weights_only=True)["optimizer_states"][0]["param_groups"][0]

    assert saved(2)["initial_lr"] == 1e-3  # the first run's schedule
    for step in (3, 4):  # the lr after each resumed step: the new schedule at that step
        assert saved(step)["initial_lr"] == 1e-5
        assert saved(step)["lr"] == pytest.approx(scheduled_lr(step, config.optim, 4), rel=1e-6), step


def test_resuming_a_run_past_a_lower_max_steps_is_one_line_and_rewrites_nothing(data_dir, pretrained, tmp_path):
    """Before: a run at step 4 rerun with trainer.max_steps=3 exited 0, its final/ the step-4 model and config.yaml
    saying 3."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(pretrained, runs)
    before = {p: p.read_bytes() for p in (runs / RUN_NAME).rglob("*") if p.is_file() and p.name != ".lantern.lock"}
    with pytest.raises(ConfigError, match=r"trainer.max_steps=3: .*step-00000004.ckpt is already at step 4; set "):
        run_pretrain(tiny_config(data_dir, runs, *QUICK[1:], "trainer.max_steps=3"))
    after = {p: p.read_bytes() for p in (runs / RUN_NAME).rglob("*") if p.is_file() and p.name != ".lantern.lock"}
    assert after == before


def test_a_sharded_checkpoint_resumed_by_a_single_process_run_says_which_strategy_reads_it(data_dir, tmp_path):
    """Before: "Is a directory", with no hint that an FSDP run wrote it."""
    sharded = tmp_path / "other" / "step-00000002.ckpt"
    sharded.mkdir(parents=True)
    (sharded / ".metadata").write_bytes(b"")
    config = tiny_config(data_dir, tmp_path / "runs", *QUICK, f"checkpoint.resume={sharded}")
    with pytest.raises(ConfigError, match=rf"{sharded} is a sharded checkpoint an FSDP run wrote .* trainer.strategy"):
        run_pretrain(config)


def test_a_resume_on_data_prepared_from_another_corpus_of_the_same_size_is_refused(tmp_path):
    """Before: re-preparing from a changed corpus with the same token count and resuming logged "resumed exactly
    where the checkpoint left the training stream" on other text; and a run recorded data.source from its config,
    not the data it read. Now each checkpoint and data_stats.json carry the prepared data's fingerprint."""
    import json

    from data.pretrain.config import PrepareConfig
    from data.pretrain.prepare import prepare

    corpus = tmp_path / "corpus.txt"
    paragraphs = [f"ROMEO:\nline {i} of the play, spoken at night." for i in range(400)]
    corpus.write_text("\n\n".join(paragraphs) + "\n")
    data = tmp_path / "data"
    prepare(PrepareConfig(source=[str(corpus)], out_dir=str(data)))
    first = (
        "trainer.max_steps=2", "checkpoint.every_n_steps=2", "trainer.val_every_n_steps=100", "logger.kind=none",
        f"data.source=[{corpus}]",
    )  # fmt: skip
    run_dir = run_pretrain(tiny_config(data, tmp_path / "runs", *first))
    recorded = json.loads((run_dir / "data_stats.json").read_text())["prepared"][""]
    assert recorded["inputs"] == [str(corpus)] and len(recorded["fingerprint"]) == 16
    corpus.write_text("\n\n".join(p.replace("night", "dawn!") for p in paragraphs) + "\n")  # other text, same size
    prepare(PrepareConfig(source=[str(corpus)], out_dir=str(data)))
    again = ("trainer.max_steps=4", *first[1:])
    with pytest.raises(DataError, match=r"the checkpoint trained on other prepared data than .* now holds"):
        run_pretrain(tiny_config(data, tmp_path / "runs", *again))
