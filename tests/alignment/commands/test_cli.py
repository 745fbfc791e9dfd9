"""The ``lantern`` command as a user types it (in-process through ``main`` unless a subprocess is needed)."""

import contextlib
import dataclasses
import importlib
import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignment.commands import cli
from alignment.commands.cli import main
from alignment.stages import registry
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parents[3]


def test_help_lists_every_stage(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in (
        "tokenizer",
        "generate",
        "convert",
        "prepare",
        "pretrain",
        "sft",
        "rm",
        "ppo",
        "pipeline",
        "export",
        "demo-data",
    ):
        assert command in out


def test_tokenizer_train_writes_a_loadable_tokenizer(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "data/corpus/tinyshakespeare.txt").read_text()[:200_000])
    out = tmp_path / "tok.tiktoken"
    assert main(["tokenizer", "train", "--corpus", str(corpus), "--vocab-size", "1024", "--out", str(out)]) == 0
    tokenizer = Tokenizer.load(str(out))
    assert tokenizer.vocab_size == 1024
    assert tokenizer.decode(tokenizer.encode("ROMEO: good night")) == "ROMEO: good night"


def test_generate_from_random_preset(capsys):
    assert (
        main(["generate", "--preset", "tiny", "--prompt", "ROMEO:", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    )
    assert capsys.readouterr().out.startswith("ROMEO:")


@pytest.fixture
def small_checkpoint(tmp_path) -> Path:
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=64)
    )
    return save_checkpoint(model, tmp_path / "native", tokenizer_path=Tokenizer.load("default").path)


def test_generate_from_checkpoint_uses_its_tokenizer_and_is_deterministic_greedy(small_checkpoint, capsys):
    args = [
        "generate",
        "--checkpoint",
        str(small_checkpoint),
        "--prompt",
        "KING:",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_generate_reads_a_gguf_file_as_it_reads_the_folder_it_came_from(small_checkpoint, tmp_path, capsys):
    """`lantern generate --checkpoint FILE.gguf` (as `lantern eval` does): the same greedy text as the folder the
    file was exported from. Before: "pass the checkpoint folder", naming no way to get one."""
    pytest.importorskip("gguf")
    gguf = tmp_path / "small.gguf"
    assert main(["convert", str(small_checkpoint), "--to", "gguf", str(gguf), "--dtype", "float32"]) == 0
    capsys.readouterr()
    texts = []
    for source in (small_checkpoint, gguf):
        args = ["generate", "--checkpoint", str(source), "--prompt", "KING:", "--max-new-tokens", "8"]
        assert main([*args, "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("KING:")


@pytest.mark.parametrize("device", ["foo", "cuda:7"])
def test_a_bad_device_is_one_line_before_any_weights_are_read(small_checkpoint, device, capsys, monkeypatch):
    """Before: a RuntimeError traceback (`--device foo`) from torch, after the model had loaded."""
    import models.formats.checkpoint as checkpoint_format

    monkeypatch.setattr(checkpoint_format, "load_checkpoint", lambda *a, **k: pytest.fail("weights read"))
    args = ["generate", "--checkpoint", str(small_checkpoint), "--prompt", "x", "--device", device]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lantern generate: error: --device {device}: ") and "\n" not in err, err


@pytest.mark.parametrize(
    ("blocked", "command", "extra"),
    [
        ("lm_eval", ["eval", "CKPT", "--tasks", "lantern_demo_choice"], "eval"),
        ("gguf", ["convert", "--from", "gguf", "GGUF", "--to", "native", "OUT"], "gguf"),
        ("gguf", ["eval", "GGUF", "--tasks", "lantern_demo_choice"], "gguf"),
        ("gguf", ["generate", "--checkpoint", "GGUF", "--prompt", "x"], "gguf"),
    ],
    ids=["eval-without-lm-eval", "convert-gguf-without-gguf", "eval-gguf-without-gguf", "generate-gguf-without-gguf"],
)
def test_a_command_needing_a_missing_extra_says_which_in_one_line(small_checkpoint, tmp_path, blocked, command, extra):
    """Before: 12-21-line ModuleNotFoundError tracebacks. A real process with the module made unimportable."""
    gguf = tmp_path / "small.gguf"
    gguf.write_bytes(b"GGUF")  # never read: the import fails first
    words = [
        {"CKPT": str(small_checkpoint), "GGUF": str(gguf), "OUT": str(tmp_path / "out")}.get(w, w) for w in command
    ]
    code = (
        f"import sys; sys.modules[{blocked!r}] = None; from alignment.commands.cli import main; "
        f"sys.exit(main({words!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.startswith("lantern ") or "Traceback" in line]
    assert done.returncode == 2, done.stderr[-3000:]
    assert lines == [
        f"lantern {command[0]}: error: needs {cli.EXTRA_OF_MODULE[blocked][1]}, which is not installed: "
        f"pip install 'lantern[{extra}]' (in a checkout: pip install -e \".[{extra}]\")"
    ], done.stderr[-3000:]


def test_generate_decode_choices_print_the_same_greedy_text(small_checkpoint, capsys, monkeypatch):
    """--decode auto (the default: eager on this CPU), eager and static print the same greedy text; --compile is
    --decode compiled; --help names the choices."""
    import models.generation as generation

    seen: list[str] = []
    original = generation.generate

    def recording(*args, **kwargs):
        seen.append(generation.resolve_decode(kwargs["decode"], "cpu"))
        return original(*args, **kwargs)

    monkeypatch.setattr(generation, "generate", recording)
    args = ["generate", "--checkpoint", str(small_checkpoint), "--prompt", "KING:", "--max-new-tokens", "8"]
    outputs = []
    for extra in ([], ["--decode", "eager"], ["--decode", "static"]):
        assert main([*args, "--temperature", "0", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and seen == ["eager", "eager", "static"]
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--decode {auto,eager,static,compiled}" in capsys.readouterr().out
    monkeypatch.setattr(generation, "generate", lambda *a, **kwargs: seen.append(kwargs["decode"]) or original(*a, **{**kwargs, "decode": "eager"}))  # fmt: skip
    assert main([*args, "--compile"]) == 0 and seen[-1] == "compiled"


def test_generate_rejects_prompt_longer_than_max_seq_len(small_checkpoint, capsys):
    assert (
        main(["generate", "--checkpoint", str(small_checkpoint), "--prompt", "word " * 100, "--max-new-tokens", "4"])
        == 2
    )
    assert "max_seq_len 64" in capsys.readouterr().err


def test_tokenizer_larger_than_model_vocab_is_a_clear_error(small_checkpoint, capsys):
    code = main(["generate", "--checkpoint", str(small_checkpoint), "--tokenizer", "cl100k_base", "--prompt", "hi"])
    assert code == 2
    err = capsys.readouterr().err
    assert "100512 tokens" in err and "vocab_size 4096" in err


def test_convert_native_to_hf_and_back(small_checkpoint, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["convert", "--from", "native", str(small_checkpoint), "--to", "hf", str(hf)]) == 0
    assert (hf / "config.json").is_file()
    back = tmp_path / "back"
    assert main(["convert", str(hf), "--to", "native", str(back)]) == 0
    ids = torch.randint(0, 4096, (1, 12))
    torch.testing.assert_close(load_checkpoint(back)(ids), load_checkpoint(small_checkpoint)(ids))


def test_config_error_is_one_line_and_exit_code_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "alignment.commands.cli", "pretrain", "configs/pretrain/tiny.yaml", "loader.seq_lenn=8"],
        cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "loader.seq_lenn" in result.stderr and "seq_len" in result.stderr


def test_help_does_not_import_torch() -> None:
    """`lantern --help` stays instant: the CLI imports torch only once a command runs."""
    code = "import sys; from alignment.commands.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout


def test_every_training_command_names_a_schema_that_imports():
    """An interrupted run reads its config again through its stage record's schema location: a name left behind by
    a move would turn the line that says how to resume into a bare "interrupted" without any test noticing. Every
    record's run function and module import too, and every stage is a command."""
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    for stage in registry.STAGES:
        module, name = stage.schema_location
        schema = getattr(importlib.import_module(module), name)
        assert dataclasses.is_dataclass(schema) and schema is stage.schema, stage.command
        assert callable(stage.recipe) and isinstance(stage.module, type), stage.name
        assert stage.command in commands, f"no command for {stage.name}"


def test_log_lines_go_to_the_stderr_of_each_call(capsys, monkeypatch):
    """main() in a long-lived process (a notebook, a test run) logs to the sys.stderr of the current call: a handler
    bound to the first call's stream would write into it after it closed ('--- Logging error ---' and a traceback)."""
    for name in ("lantern", "trainer", "data", "models", "alignment"):
        monkeypatch.setattr(logging.getLogger(name), "handlers", [])  # as in a fresh process
    first = io.StringIO()
    with contextlib.redirect_stderr(first):
        cli._configure_logging(logging.INFO)  # what main() does first
        logging.getLogger("trainer.checks").warning("during the first call")
    assert first.getvalue() == "WARNING trainer.checks: during the first call\n"
    first.close()
    logging.getLogger("trainer.checks").warning("after the first call")
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err == "WARNING trainer.checks: after the first call\n"


def test_a_run_builds_only_its_own_subcommand_and_help_lists_them_all(capsys):
    """``main`` builds the arguments of the command it runs alone (a run does not read every command's module);
    the full parser (``--help``, an unknown command) has exactly ``cli.COMMANDS`` and the stages' commands."""
    every = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert every == {*cli.COMMANDS, *(stage.command for stage in registry.STAGES)}
    for name in every:
        assert set(cli.build_parser(name)._subparsers._group_actions[0].choices) == {name}
    with pytest.raises(SystemExit):
        cli.main(["-v", "sft"])  # the stage's own parser: its config is missing
    assert "usage: lantern sft [-h] config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])
    err = capsys.readouterr().err
    assert "invalid choice: 'no-such-command'" in err and "demo-data" in err and "grpo" in err
