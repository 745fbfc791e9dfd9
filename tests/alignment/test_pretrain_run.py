"""End-to-end pretraining runs on CPU with the tiny model: what a run leaves behind, W&B offline logging,
NaN handling, and bad input caught before any compute.

The bundled corpus is prepared once per module; every run is in-process (``run_pretrain``) except the CLI
check, and short (a few optimizer steps of a ~1.8M-parameter model).
"""

from __future__ import annotations

import csv
import math
import struct
import time
import warnings
import zlib
from pathlib import Path

import lightning as L
import pytest
import torch

from alignment.schemas.pretrain import PretrainConfig
from alignment.stages.pretrain import run_pretrain
from data.pretrain.config import PrepareConfig
from data.pretrain.manifest import read_manifest
from data.pretrain.prepare import prepare
from data.tokenizer.tokenizer import Tokenizer
from models.errors import ConfigError, NonFiniteLossError
from tests.helpers import assert_transformers_loads, run_lantern
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "pretrain" / "tiny.yaml"
CORPUS = ROOT / "data" / "corpus" / "tinyshakespeare.txt"
RUN_NAME = "pretrain-tiny"  # run.name in tiny.yaml

LONG_PARAGRAPH = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief, that thou her "
    "maid art far more fair than she. Be not her maid, since she is envious; her vestal livery is but sick "
    "and green, and none but fools do wear it; cast it off. It is my lady, O, it is my love! O, that she "
    "knew she were! She speaks yet she says nothing: what of that? Her eye discourses; I will answer it."
)
SHORT_PARAGRAPH = "JULIET: Ay me!"


# --------------------------------------------------------------------------------------------------
# helpers


def tiny_config(data_dir: Path, runs: Path, *overrides: str) -> PretrainConfig:
    return load_config(
        PretrainConfig,
        TINY,
        [f"data.source=[{CORPUS}]", f"data.out_dir={data_dir}", f"run.out_dir={runs}", *overrides],
    )


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """LossPlot's metrics.csv (columns metric, step, value) as {metric: [(step, value), ...]}."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "metrics.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == ["metric", "step", "value"]
        for row in reader:
            series.setdefault(row["metric"], []).append((int(row["step"]), float(row["value"])))
    return series


def checkpoint_files(run_dir: Path) -> list[Path]:
    directory = run_dir / "checkpoints"
    return sorted(directory.iterdir()) if directory.is_dir() else []


def assert_no_compute(run_dir: Path) -> None:
    """Nothing was trained: no checkpoint of any kind and no exported model."""
    assert checkpoint_files(run_dir) == [], f"checkpoints were written: {checkpoint_files(run_dir)}"
    assert not (run_dir / "final").exists()


def wandb_records(path: Path):
    """Decoded records of a W&B transaction log (``run-*.wandb``): the LevelDB log format W&B writes
    (a 7-byte file header ``:W&B`` + magic + version, then 32 KiB blocks of chunks, each with a CRC32,
    length and type), each record a ``wandb_internal_pb2.Record``. wandb 0.31 ships no Python reader."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:header])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B transaction log"
    position, pending = header, b""
    while position + header <= len(data):
        left = block - position % block
        if left < header:  # the rest of a block too short for a chunk header is padding
            position += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[position : position + header])
        if crc == length == kind == 0:  # zero padding up to the next block
            position += left
            continue
        chunk = data[position + header : position + header + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"corrupt chunk at byte {position} of {path}"
        position += header + length
        if kind == 1:  # full
            raw = chunk
        elif kind == 2:  # first
            pending = chunk
            continue
        elif kind == 3:  # middle
            pending += chunk
            continue
        else:  # last
            raw = pending + chunk
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        yield record


def wandb_history(path: Path) -> tuple[list[dict[str, float]], set[str]]:
    """(history rows as {metric: value}, the kinds of records seen)."""
    import json

    rows, kinds = [], set()
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        kinds.add(kind)
        if kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows, kinds


def isolate_wandb(monkeypatch, tmp_path: Path) -> None:
    """No API key (so ``mode: auto`` means offline) and W&B's own config/cache kept out of $HOME."""
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(variable, raising=False)
    for variable, folder in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        (tmp_path / "wandb-home" / folder).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home" / folder))


# --------------------------------------------------------------------------------------------------
# a complete run


def test_tiny_run_learns_and_writes_its_artifacts(data_dir, tmp_path):
    from models.formats.checkpoint import load_checkpoint

    config = tiny_config(data_dir, tmp_path / "runs")  # 20 steps, validation at 10 and 20, checkpoints at 10, 20
    run_dir = run_pretrain(config)
    assert run_dir == tmp_path / "runs" / RUN_NAME

    # validation loss went down, and metrics.csv holds one point per validation (not a stale copy per step)
    metrics = read_metrics(run_dir)
    val = metrics["val/loss"]
    assert [step for step, _ in val] == [10, 20], val
    assert val[-1][1] < val[0][1], f"validation loss did not go down: {val}"
    train = metrics["train/loss"]
    assert [step for step, _ in train] == list(range(1, 21))
    assert all(math.isfinite(value) for _, value in train + val)

    # config.yaml reloads to the very config the run used
    assert load_config(PretrainConfig, run_dir / "config.yaml") == config

    # checkpoints: keep_last=2 of the saves at steps 10 and 20, `latest` names the newest, all loadable safely
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*.ckpt")) == ["step-00000010.ckpt", "step-00000020.ckpt"]
    assert (checkpoints / "latest").read_text().strip() == "step-00000020.ckpt"
    assert not list(checkpoints.glob(".tmp-*"))
    last = torch.load(checkpoints / "step-00000020.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 20

    # final/: a native checkpoint of the same model, equal to the last training checkpoint's weights
    model = load_checkpoint(run_dir / "final")
    assert model.config == config.model
    state = model.state_dict()
    for name, tensor in last["state_dict"].items():
        assert name.startswith("model.")
        torch.testing.assert_close(state[name[len("model.") :]].float(), tensor.float(), rtol=0, atol=0)
    # ... and a folder transformers loads as it is: the same logits, and its tokenizer the same ids
    assert_transformers_loads(run_dir / "final", model, Tokenizer.load("default"))

    # loss.png: a real PNG with something drawn in it
    png = (run_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 1024


# --------------------------------------------------------------------------------------------------
# W&B offline


def test_wandb_offline_run_holds_the_logged_metrics(data_dir, tmp_path, monkeypatch):
    isolate_wandb(monkeypatch, tmp_path)
    config = tiny_config(
        data_dir,
        tmp_path / "runs",
        "logger.kind=wandb",
        "logger.mode=auto",
        "trainer.max_steps=4",
        "trainer.val_every_n_steps=2",
        "checkpoint.every_n_steps=2",
    )
    run_dir = run_pretrain(config)

    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, f"expected one offline W&B run in {run_dir / 'wandb'}, found {offline}"
    logs = list(offline[0].glob("run-*.wandb"))
    assert len(logs) == 1
    # wandb.finish() has returned; W&B's service process writes the log's last blocks on its own, a moment later
    # on a loaded machine (CI saw an unflushed log once), so the exit record is awaited, not raced
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if "exit" in wandb_history(logs[0])[1]:
                break
        except AssertionError:  # a chunk still being written: its CRC does not match yet
            pass
        time.sleep(0.5)
    rows, kinds = wandb_history(logs[0])
    assert "exit" in kinds, "the W&B run was not finished (no exit record): `wandb sync` would see a crashed run"
    assert "config" in kinds

    # Every loss LossPlot wrote to metrics.csv is in the W&B history, at one consistent step offset
    # (W&B is indexed by Lightning's logging step, metrics.csv by optimizer steps done).
    metrics = read_metrics(run_dir)
    offsets = set()
    for name in ("train/loss", "val/loss"):
        logged = [(row["trainer/global_step"], row[name]) for row in rows if name in row]
        assert logged, f"no {name} in the W&B history"
        for step, value in metrics[name]:
            matches = [wandb_step for wandb_step, wandb_value in logged if wandb_value == value]
            assert matches, f"{name}={value} at step {step} (metrics.csv) is not in W&B: {logged}"
            offsets.add(step - matches[0])
    assert len(offsets) == 1, f"W&B and metrics.csv disagree on steps inconsistently: offsets {offsets}"
    assert len([row for row in rows if "train/loss" in row]) == 4
    assert len([row for row in rows if "val/loss" in row]) == 2
    assert any("tokens_per_second" in row for row in rows)


def test_wandb_failure_never_crashes_a_run(data_dir, tmp_path, monkeypatch):
    import wandb.sdk.wandb_run

    isolate_wandb(monkeypatch, tmp_path)
    calls = []

    def broken_log(self, *args, **kwargs):
        calls.append(args)
        raise OSError("No space left on device")

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", broken_log)
    config = tiny_config(
        data_dir, tmp_path / "runs", "logger.kind=wandb", "trainer.max_steps=3", "trainer.val_every_n_steps=2"
    )
    with pytest.warns(UserWarning, match="W&B log_metrics failed"):
        run_dir = run_pretrain(config)
    assert calls, "W&B's Run.log was never called: the failure was not exercised"
    assert len(calls) == 1, "after the first failure W&B logging should be off"
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000003.ckpt"
    assert [step for step, _ in read_metrics(run_dir)["train/loss"]] == [1, 2, 3]


# --------------------------------------------------------------------------------------------------
# NaN / Inf


class PoisonWeights(L.Callback):
    """Fills a weight with NaN just before the batch of optimizer step ``at_step`` (0-based global step)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.at_step:
            with torch.no_grad():
                pl_module.model.norm.weight.fill_(float("nan"))


def test_nan_loss_stops_with_the_last_good_checkpoint_intact(data_dir, tmp_path):
    runs = tmp_path / "runs"
    overrides = [
        "trainer.max_steps=8",
        "trainer.val_every_n_steps=100",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep_last=3",
    ]
    with pytest.raises(NonFiniteLossError, match=r"\bstep 5\b"):
        run_pretrain(tiny_config(data_dir, runs, *overrides), extra_callbacks=[PoisonWeights(at_step=5)])
    run_dir = runs / RUN_NAME
    checkpoints = run_dir / "checkpoints"

    # the saves at steps 2 and 4 happened; nothing after the failure, and no export of the broken model
    assert sorted(p.name for p in checkpoints.glob("step-*.ckpt")) == ["step-00000002.ckpt", "step-00000004.ckpt"]
    assert (checkpoints / "latest").read_text().strip() == "step-00000004.ckpt"
    assert not list(checkpoints.glob(".tmp-*"))
    assert not (run_dir / "final").exists()

    good = torch.load(checkpoints / "step-00000004.ckpt", map_location="cpu", weights_only=True)
    assert good["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in good["state_dict"].values())

    # and training resumes from it (checkpoint.resume=auto) to the end
    run_pretrain(tiny_config(data_dir, runs, *overrides))
    assert (checkpoints / "latest").read_text().strip() == "step-00000008.ckpt"
    resumed = torch.load(checkpoints / "step-00000008.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 8
    assert (run_dir / "final" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------------
# bad input, caught before any compute


def test_prepare_missing_corpus_file(tmp_path):
    missing = tmp_path / "no-such-corpus.txt"
    with pytest.raises(FileNotFoundError, match="no-such-corpus.txt"):
        prepare(PrepareConfig(source=[str(missing)], out_dir=str(tmp_path / "data")))
    assert not (tmp_path / "data" / "manifest.json").exists()


@pytest.mark.parametrize("text", ["", "\n\n  \n\n\t\n"], ids=["empty", "whitespace"])
def test_prepare_empty_corpus(tmp_path, text):
    corpus = tmp_path / "empty.txt"
    corpus.write_text(text)
    with pytest.raises(ValueError, match=r"empty corpus.*empty\.txt"):
        prepare(PrepareConfig(source=[str(corpus)], out_dir=str(tmp_path / "data"), num_proc=1))
    assert not (tmp_path / "data" / "manifest.json").exists()


def test_split_shorter_than_one_sequence(tmp_path):
    corpus = tmp_path / "two-paragraphs.txt"
    corpus.write_text(f"{LONG_PARAGRAPH}\n\n{SHORT_PARAGRAPH}\n")
    data = tmp_path / "data"
    prepare(PrepareConfig(source=[str(corpus)], out_dir=str(data), val_fraction=0.5, num_proc=1))
    splits = read_manifest(data)["splits"]
    val_tokens, train_tokens = splits["val"]["tokens"], splits["train"]["tokens"]
    seq_len = 32
    assert val_tokens < seq_len + 1 < train_tokens // 2, f"the seeded split changed: {splits}"

    config = tiny_config(
        data, tmp_path / "runs", f"data.source=[{corpus}]", f"loader.seq_len={seq_len}", "loader.micro_batch_size=1"
    )
    with pytest.raises(ValueError, match=rf"split 'val' in {data}.*{val_tokens} tokens.*seq_len\+1={seq_len + 1}"):
        run_pretrain(config)
    assert_no_compute(tmp_path / "runs" / RUN_NAME)


def test_seq_len_above_model_max_seq_len(data_dir, tmp_path):
    config = tiny_config(data_dir, tmp_path / "runs", "loader.seq_len=512")
    with pytest.raises(ConfigError, match=r"loader.seq_len \(512\).*model.max_seq_len \(256\)"):
        run_pretrain(config)
    assert_no_compute(tmp_path / "runs" / RUN_NAME)


def test_tokenizer_larger_than_model_vocab(data_dir, tmp_path):
    config = tiny_config(data_dir, tmp_path / "runs", "model.vocab_size=1000")
    with pytest.raises(ValueError, match=r"shakespeare-4096.*4096 tokens.*model.vocab_size.*1000"):
        run_pretrain(config)
    assert_no_compute(tmp_path / "runs" / RUN_NAME)


@pytest.mark.parametrize("key, value", [("trainer.strategy", "fsdp3"), ("trainer.precision", "fp8")])
def test_unknown_strategy_or_precision(data_dir, tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"{key}.*{value}"):
        tiny_config(data_dir, tmp_path / "runs", f"{key}={value}")


def test_single_strategy_with_two_devices(data_dir, tmp_path):
    # refused where the config is loaded, before a run starts
    with pytest.raises(ConfigError, match=r"trainer.strategy 'single'.*trainer.devices=2"):
        run_pretrain(
            tiny_config(
                data_dir, tmp_path / "runs", "trainer.strategy=single", "trainer.devices=2", "trainer.accelerator=cpu"
            )
        )
    assert_no_compute(tmp_path / "runs" / RUN_NAME)


def test_data_prepared_with_another_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join([LONG_PARAGRAPH] * 8) + "\n")
    data = tmp_path / "data-cl100k"
    prepare(
        PrepareConfig(source=[str(corpus)], out_dir=str(data), tokenizer="cl100k_base", val_fraction=0.25, num_proc=1)
    )

    config = tiny_config(data, tmp_path / "runs", f"data.source=[{corpus}]")  # tokenizer: default
    with pytest.raises(ValueError) as error:
        run_pretrain(config)
    message = str(error.value)
    assert "cl100k_base" in message and "shakespeare-4096" in message, message
    assert "re-run `lantern prepare`" in message
    assert_no_compute(tmp_path / "runs" / RUN_NAME)


# --------------------------------------------------------------------------------------------------
# the command line


def test_cli_config_error_is_one_clean_line(tmp_path):
    result = run_lantern("pretrain", str(TINY), "trainer.max_stepz=3", f"run.out_dir={tmp_path}", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lantern pretrain: error:")
    assert "trainer.max_stepz" in lines[0] and "max_steps" in lines[0]
    assert not any(tmp_path.iterdir()), "a config error must not create a run folder"


def test_a_default_run_shows_no_warning_the_user_did_not_cause(data_dir, tmp_path, monkeypatch):
    """A newcomer's run prints no third-party warning they can do nothing about (Lightning's pytree code calling
    torch's deprecated LeafSpec, W&B's anonymous setting): every warning left must have a cause in the config."""
    isolate_wandb(monkeypatch, tmp_path)
    config = tiny_config(data_dir, tmp_path / "runs", "trainer.max_steps=2", "trainer.val_every_n_steps=2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_pretrain(config)
    shown = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    assert shown == []
