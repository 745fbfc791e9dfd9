"""Lantern installs like a library: the presets, the bundled corpus and the tokenizer ship in the wheel and are
found through the installed packages (``importlib.resources``), not through the checkout or the working
directory, so README commands such as ``lantern pretrain configs/pretrain/tiny.yaml`` work from anywhere."""

from __future__ import annotations

import importlib.resources
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from alignment.schemas.pretrain import PretrainConfig
from data.tokenizer.tokenizer import Tokenizer
from models.model import ModelConfig
from tests.helpers import subprocess_env
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [
    "configs/__init__.py",
    "configs/model/tiny.yaml",
    "configs/pipeline/default.yaml",
    "data/corpus/tinyshakespeare.txt",
    "data/assets/shakespeare-4096.tiktoken",
]

# Run from a folder that has no configs/ or data/: presets, stage configs, corpus and tokenizer must come from
# the packages. argv[1]: the folder the packages must be imported from.
FROM_ELSEWHERE = textwrap.dedent(
    """
    import importlib.resources, json, sys
    from pathlib import Path

    import models
    from data.tokenizer.tokenizer import Tokenizer
    from models.model import ModelConfig
    from data.pretrain.sources import resolve_inputs
    from models.config_checks import shipped_path
    from alignment.schemas.pretrain import PretrainConfig
    from trainer.config import load_config
    from alignment.commands.pipeline import Pipeline, PipelineConfig

    Path("own.yaml").write_text("model: tiny\\n")
    pretrain = load_config(PretrainConfig, "configs/pretrain/tiny.yaml")  # itself says model: tiny
    pipeline = Pipeline(load_config(PipelineConfig, "configs/pipeline/tiny.yaml"))
    stage, _ = pipeline.load_stage_config("pretrain")  # the stage config path inside the pipeline preset
    corpus = importlib.resources.files("data") / "corpus" / "tinyshakespeare.txt"
    print(json.dumps({
        "models": models.__file__,
        "configs": str(importlib.resources.files("configs")),
        "resolved": str(shipped_path("configs/pretrain/tiny.yaml")),
        "corpus": str(shipped_path("data/corpus/tinyshakespeare.txt")),
        "corpus_is_file": corpus.is_file(),
        "prepare_inputs": resolve_inputs(pretrain.data)[1],  # the preset's data/corpus/... source
        "own_dim": load_config(PretrainConfig, "own.yaml").model.dim,
        "preset_dim": ModelConfig.from_preset("tiny").dim,
        "pretrain": [pretrain.run.name, pretrain.model.dim],
        "stage": [stage.run.name, stage.model.dim, stage.trainer.max_steps],
        "tokenizer": Tokenizer.load("default").vocab_size,
    }))
    """
)


def run_elsewhere(cwd: Path, pythonpath: Path) -> dict:
    cwd.mkdir(parents=True, exist_ok=True)
    env = subprocess_env(PYTHONPATH=str(pythonpath))
    done = subprocess.run(
        [sys.executable, "-c", FROM_ELSEWHERE], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_found_in(found: dict, packages: Path) -> None:
    assert Path(found["models"]).is_relative_to(packages)
    assert found["configs"] == str(packages / "configs")
    assert found["resolved"] == str(packages / "configs" / "pretrain" / "tiny.yaml")
    assert found["corpus"] == str(packages / "data" / "corpus" / "tinyshakespeare.txt") and found["corpus_is_file"]
    assert found["prepare_inputs"] == [found["corpus"]]
    tiny = ModelConfig.from_preset("tiny").dim
    assert found["own_dim"] == found["preset_dim"] == tiny
    assert found["pretrain"] == ["pretrain-tiny", tiny]
    assert found["stage"] == ["pretrain", tiny, 4]  # configs/pipeline/tiny.yaml's override of the stage preset
    assert found["tokenizer"] == Tokenizer.load("default").vocab_size


def test_source_tree_presets_come_from_the_packages_not_the_working_directory(tmp_path):
    check_found_in(run_elsewhere(tmp_path / "elsewhere", ROOT), ROOT)


def test_model_presets_are_read_through_importlib_resources(tmp_path, monkeypatch):
    presets = tmp_path / "configs" / "model"
    presets.mkdir(parents=True)
    (presets / "tiny.yaml").write_text("dim: 64\nn_layers: 1\nn_heads: 4\nn_kv_heads: 4\nvocab_size: 512\n")
    real = importlib.resources.files
    monkeypatch.setattr(importlib.resources, "files", lambda p: tmp_path / "configs" if p == "configs" else real(p))
    assert ModelConfig.from_preset("tiny").dim == 64
    assert load_config(PretrainConfig, None, ["model=tiny"]).model.dim == 64
    with pytest.raises(FileNotFoundError, match=r"presets: \['tiny'\]"):
        ModelConfig.from_preset("small")


def test_a_config_in_the_working_directory_wins_over_the_shipped_one(tmp_path, monkeypatch):
    own = tmp_path / "configs" / "pretrain" / "tiny.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("run: {name: mine}\nmodel: tiny\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(PretrainConfig, "configs/pretrain/tiny.yaml").run.name == "mine"


def test_wheel_ships_presets_corpus_and_tokenizer_and_runs_from_them(tmp_path):
    """Build the wheel offline from a copy of the checkout (an in-tree build leaves build/ behind), check what it
    holds, unpack it as pip would and load every shipped file from another folder, the checkout out of reach."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in sorted(init.parent for init in ROOT.glob("*/__init__.py")):
        shutil.copytree(package, source / package.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    command = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index"]
    built = subprocess.run(
        [*command, "-w", str(tmp_path / "dist")], cwd=source, capture_output=True, text=True, timeout=600
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lantern-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")  # what pip install does with a pure-Python wheel's files
    shipped_configs = {str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*/*.yaml")}
    assert set(SHIPPED) | shipped_configs <= names
    assert not {name for name in names if name.split("/")[0] in ("tests", "benchmarks")}

    check_found_in(run_elsewhere(tmp_path / "elsewhere", tmp_path / "site"), tmp_path / "site")
