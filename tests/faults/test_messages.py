"""What Lantern says when something stops or is misaimed: the truth, and what to do next.

- ``lantern prepare`` stopped by SIGTERM while its workers tokenize: exit 143 and one line saying that it stopped,
  what is left of the folder and that the same command prepares it from the start (not ``datasets``' empty
  TimeoutError), in bounded time (a worker the pool forks after the signal never holds the exit up).
- A folder given where files are expected (``data.source``, ``data.train``): the glob of what the folder holds
  (``*.jsonl``, ``*.parquet``), not ``*.txt`` whatever it holds; or, when it holds nothing readable, what is read.
- A resumed run: Lightning's warning that the dataloader is not resumable is not raised (Lantern's train loader is
  resumable in Lightning's own sense) and the datamodule says once, on rank 0, that the data position was resumed.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings
from pathlib import Path

import pytest

from alignment.commands.cli import main as lantern
from data.records.chat import resolve_sources
from data.sft.rows import SFTDataConfig
from models.files.folders import lock_folder, release_folder
from tests.faults.test_orphans import DEATH_TIMEOUT, TINY, driven, wait_for_markers, write_corpus
from tests.helpers import write_jsonl

# --------------------------------------------------------------------------------------------------
# an interrupted prepare


def test_an_interrupted_prepare_says_it_stopped_and_that_the_same_command_starts_it_over(tmp_path):
    corpus, out = write_corpus(tmp_path / "corpus.txt"), tmp_path / "data"
    args = ["prepare", TINY, f"data.source=[{corpus}]", f"data.out_dir={out}", "data.num_proc=2"]
    stderr = tmp_path / "prepare.err"
    with driven(args, tmp_path / "markers", stderr) as process:
        wait_for_markers(process, tmp_path / "markers", 2, stderr)  # both workers tokenizing
        os.killpg(process.pid, signal.SIGTERM)  # to the whole group, as a scheduler's stop does
        assert process.wait(timeout=DEATH_TIMEOUT) == 143, stderr.read_text()[-3000:]
    lines = [line for line in stderr.read_text().splitlines() if line.startswith("lantern prepare")]
    assert lines == [
        f"lantern prepare: interrupted by SIGTERM; prepare stopped before it finished {out} (nothing was kept); "
        "the same command prepares it from the start"
    ]
    assert not list(out.glob(".prepare-*"))  # the unfinished build is gone: nothing to resume from
    lock_folder(out, what="data folder", hint="")
    release_folder(out)


# --------------------------------------------------------------------------------------------------
# a folder where files are expected


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("lantern ")]
    return line


def test_a_folder_given_as_data_names_the_glob_of_what_it_holds(tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        write_jsonl(folder / name, [{"text": "to be or not to be"}])
    (folder / "notes.md.bak").write_text("not data")
    assert lantern(["prepare", TINY, f"data.source=[{folder}]", f"data.out_dir={tmp_path / 'out'}"]) == 2
    line = error_line(capsys)
    assert f"is a folder; give files or a glob: '{folder}/*.jsonl' (2 files)" in line and "*.txt" not in line
    # SFT reads JSON lines and Parquet: a folder of them in sub-folders, then one holding text only
    nested = tmp_path / "sft" / "part-1"
    nested.mkdir(parents=True)
    write_jsonl(nested / "train.jsonl", [{"prompt": "hi", "response": "hello"}])
    (nested / "notes.txt").write_text("not SFT data")
    with pytest.raises(ValueError, match=rf"give files or a glob: '{tmp_path}/sft/\*\*/\*\.jsonl' \(1 file\)$"):
        resolve_sources(SFTDataConfig(train=[str(tmp_path / "sft")]), [str(tmp_path / "sft")])
    (nested / "train.jsonl").unlink()
    with pytest.raises(ValueError, match=r"holding no file to read \(\.json, \.jsonl, \.ndjson, \.parquet, or"):
        resolve_sources(SFTDataConfig(train=[str(tmp_path / "sft")]), [str(tmp_path / "sft")])


# --------------------------------------------------------------------------------------------------
# a resumed run


@pytest.fixture(scope="module")
def policy_and_prompts(tmp_path_factory) -> dict[str, Path]:
    import torch

    from data.demo.tasks import write_demo_dataset
    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.checkpoint import save_checkpoint
    from models.model import ModelConfig, Transformer

    root = tmp_path_factory.mktemp("grpo")
    torch.manual_seed(0)
    policy = Transformer(
        ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=256)
    )
    demo = write_demo_dataset(root / "demo", n_train=20, n_val=40, n_pairs=10, seed=0)
    policy_dir = save_checkpoint(policy, root / "sft", tokenizer_path=Tokenizer.load("default").path)
    return {"policy": policy_dir, "train": demo["train_prompts"], "val": demo["prompts"]}


def test_a_resumed_run_says_its_data_resumed_and_lightning_does_not_warn(policy_and_prompts, tmp_path, caplog):
    """GRPO's prompt stream (the loader that lacked Lightning's protocol), resumed in the middle of its epoch."""
    from alignment.schemas.rl import GRPOConfig
    from alignment.stages.grpo import run_grpo
    from trainer.config import load_config

    def config(steps: int) -> GRPOConfig:
        return load_config(
            GRPOConfig,
            Path(__file__).resolve().parents[2] / "configs/grpo/tiny.yaml",
            [
                f"init.policy={policy_and_prompts['policy']}",
                f"data.train=[{policy_and_prompts['train']}]",
                f"data.val=[{policy_and_prompts['val']}]",
                f"run.out_dir={tmp_path}",
                "logger.kind=none",
                f"trainer.max_steps={steps}",
                "checkpoint.every_n_steps=1",
                "grpo.response_max_tokens=4",
                "eval.generations=2",
                "eval.every_n_rollouts=100",
                "eval.pass_k=0",
            ],
        )

    run_grpo(config(1))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="lantern.data"):
        warnings.simplefilter("always")
        run_grpo(config(2))
    assert not [w for w in caught if "resum" in str(w.message)], [str(w.message) for w in caught]
    said = [r.getMessage() for r in caplog.records if r.name == "lantern.data" and "resumed" in r.getMessage()]
    assert said == ["data: resumed exactly where the checkpoint left the training stream, 4 samples in"], said
