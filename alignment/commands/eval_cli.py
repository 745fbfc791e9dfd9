"""``lantern eval CHECKPOINT --tasks T1,T2``: lm-evaluation-harness tasks over any checkpoint Lantern loads, with its
own tokenizer and chat template; results as lm-eval writes them, a table printed and written beside them, and W&B
where asked. Names, task data and the tokenizer are checked before the weights are read; lm-eval and torch are
imported only when the command runs."""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from models.errors import LanternError

log = logging.getLogger("lantern")
DTYPES = ("float32", "bfloat16", "float16")


def _task_names(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one task, e.g. --tasks hellaswag,arc_easy")
    return names


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def _limit(value: str) -> int | float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (a count, or a fraction below 1 of each task), got {value}")
    return number if number < 1 else int(number)


def add_eval_command(commands: Any) -> None:
    """``lantern eval`` on ``commands``."""
    run = commands.add_parser("eval", help="score a checkpoint on lm-evaluation-harness tasks (lm-eval's metrics)")
    run.add_argument(
        "checkpoint",
        help="model folder (native, Hugging Face, Meta), .gguf file, or training checkpoint (.ckpt file or sharded "
        "folder; LoRA adapters are merged)",
    )
    run.add_argument("--tasks", required=True, type=_task_names, help="comma-separated lm-eval task or group names")
    run.add_argument(
        "--num-fewshot", type=_non_negative_int, default=None, help="few-shot examples (default: each task's own)"
    )
    run.add_argument("--limit", type=_limit, default=None, help="examples per task: a count, or a fraction below 1")
    run.add_argument("--batch-size", type=_positive_int, default=8, help="rows per forward, prompts per generate")
    run.add_argument("--apply-chat-template", action="store_true", help="prompts through the checkpoint's template")
    run.add_argument("--out", default=None, help="results folder (default: runs/eval/<checkpoint name>)")
    run.add_argument(
        "--include-path", action="append", default=[], metavar="DIR",
        help="a folder of lm-eval task YAMLs (repeatable); `lantern demo-data` writes the demo tasks' in harness/",
    )  # fmt: skip
    run.add_argument("--tokenizer", help="tokenizer file or folder (default: the checkpoint's own)")
    run.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    run.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    run.add_argument("--max-length", type=_positive_int, default=None, help="context kept (default: the model's)")
    run.add_argument(
        "--confirm-run-unsafe-code", action="store_true",
        help="run the generated code of code tasks (humaneval_local), lm-eval's opt-in",
    )  # fmt: skip
    run.add_argument("--log-samples", action="store_true", help="also write every request and response")
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--wandb-project", default=None, help="log the results to this W&B project (offline by default)")
    run.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> None:
    from trainer.hardware import command_device
    from trainer.harness_tasks import load_tasks, refuse_unsafe_code, resolve_tasks, task_manager

    device = command_device(args.device)  # a bad --device in one line, before tasks and weights are read
    manager = task_manager(args.include_path, args.tasks)
    tasks = resolve_tasks(args.tasks, manager)
    refuse_unsafe_code(tasks, args.confirm_run_unsafe_code, key="--tasks", opt_in="--confirm-run-unsafe-code")
    out = Path(args.out or Path("runs") / "eval" / Path(args.checkpoint).name.removesuffix(".gguf"))
    from models.files.folders import claim_folder

    claim_folder(out, "evaluation", key="--out")
    load_tasks(tasks, manager)
    with tempfile.TemporaryDirectory(prefix="lantern-eval-") as scratch:
        model, tokenizer = load_model(args.checkpoint, args.tokenizer, scratch)
        lm = _harness_model(model, tokenizer, device, args)
        from trainer.harness import evaluate

        results = evaluate(
            lm, tasks, manager, num_fewshot=args.num_fewshot, limit=args.limit,
            apply_chat_template=args.apply_chat_template, confirm_run_unsafe_code=args.confirm_run_unsafe_code,
            log_samples=args.log_samples, seed=args.seed,
        )  # fmt: skip
    write_results(results, out, args)


def load_model(checkpoint: str, tokenizer_spec: str | None, scratch: str) -> tuple[Any, Any]:
    """(model on CPU, its tokenizer) of a folder, a GGUF file or a training checkpoint, the tokenizer checked against
    the model before the weights are read where the format allows."""
    from trainer.checks import check_model_tokenizer
    from trainer.model_sources import load_source_model, source_kind, source_model_config, source_tokenizer

    path = Path(checkpoint)
    if not path.exists():
        raise LanternError(f"{checkpoint}: no such checkpoint (a model folder, a .gguf file or a training checkpoint)")
    kind = source_kind(path)
    if kind == "folder":
        config = source_model_config(path)
        _, tokenizer = check_model_tokenizer(tokenizer_spec or "auto", config, path, key="--tokenizer", vocab_key=None)
        return load_source_model(path), tokenizer
    carried = source_tokenizer(path, scratch)  # a GGUF's written as Hugging Face files; a training run's recorded
    model = load_source_model(path)
    if kind == "gguf":
        _, tokenizer = check_model_tokenizer(tokenizer_spec or carried, model.config, None, key="--tokenizer")
    else:
        _, tokenizer = check_model_tokenizer(tokenizer_spec or carried or "default", model.config, None)
    return model, tokenizer


def _harness_model(model: Any, tokenizer: Any, device: str, args: argparse.Namespace) -> Any:
    import torch

    from trainer.harness import LanternLM

    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    model = model.to(device=device, dtype=dtype)
    return LanternLM(model, tokenizer, batch_size=args.batch_size, max_length=args.max_length)


def write_results(results: dict, out: Path, args: argparse.Namespace) -> None:
    """lm-eval's results JSON (and samples) through its own tracker, ``table.md``, and W&B where asked."""
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import make_table

    from models.files.atomic import remove_path, storage_error, write_atomically

    tracker = EvaluationTracker(output_path=str(out))
    samples = results.pop("samples", None)
    tracker.general_config_tracker.log_experiment_args(
        model_source="lantern", model_args=f"pretrained={args.checkpoint}", system_instruction=None,
        chat_template=None, fewshot_as_multiturn=args.apply_chat_template and bool(args.num_fewshot),
    )  # fmt: skip
    before = set(out.rglob("*"))
    table = make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else "")
    try:
        # lm-eval's tracker writes in place: on a full disk a half-written samples file and a results JSON would
        # stay, so what this call wrote is removed and the error says so
        tracker.save_results_aggregated(results=results, samples=samples)
        if samples:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
        write_atomically(out / "table.md", table)
    except OSError as error:
        for path in sorted(set(out.rglob("*")) - before, reverse=True):
            remove_path(path)
        raise storage_error(error, out, "evaluation results", kept="the files it had begun are removed") from error
    print(table)
    print(f"results: {out}")
    if args.wandb_project:
        _log_to_wandb(results, out, args)


def _log_to_wandb(results: dict, out: Path, args: argparse.Namespace) -> None:
    """The per-task metrics as one W&B run's summary (offline unless asked otherwise); never fails the command."""
    from trainer.config import LoggerConfig
    from trainer.harness import flat_metrics
    from trainer.loggers import recorded_run

    metrics = flat_metrics(results)
    config = LoggerConfig(kind="wandb", project=args.wandb_project)
    identity = {"project": args.wandb_project, "group": "eval", "job_type": "eval", "name": out.name}
    with recorded_run(out, config, **identity) as run:
        if run is not None:
            run.log(metrics)
            run.summary.update(metrics)
            run.config.update({"checkpoint": str(args.checkpoint), "tasks": args.tasks}, allow_val_change=True)
    log.info("W&B: %s", json.dumps(sorted(metrics))[:200])
