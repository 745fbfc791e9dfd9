"""The demo tasks as lm-evaluation-harness tasks over local files, one of each request type lm-eval has: a multiple
choice (``lantern_demo_choice``: a held-out prompt's right answer against a rule-made wrong one), a perplexity task
(``lantern_demo_passages``: held-out speeches) and a generation task (``lantern_demo_answers``: the short-answer
tasks, exact match). Every example comes from the held-out ("val") speeches. They are built in by name
(``demo_task_config``: their rows written once to Lantern's cache folder); ``lantern demo-data`` writes a folder of
them with its own seed for ``--include-path``."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import yaml

from data.demo.corpus import DEFAULT_CORPUS, load_corpus
from data.demo.examples import build_examples, build_pairs
from models.files.atomic import write_atomically

# A base model answers after "Answer:"; --apply-chat-template sends the same text as a user turn.
PROMPT = "{{prompt}}\nAnswer:"
TASKS = {
    "lantern_demo_choice": {
        "output_type": "multiple_choice",
        "doc_to_text": PROMPT,
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": " ",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    },
    "lantern_demo_passages": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
    },
    "lantern_demo_answers": {
        "output_type": "generate_until",
        "doc_to_text": PROMPT,
        "doc_to_target": "{{answer}}",
        "target_delimiter": " ",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 16, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "regexes_to_ignore": [r"^\s+", r"\s+$"]}],  # the answer's own spaces are not an error
    },
}  # fmt: skip


def harness_rows(n: int, *, seed: int, corpus_path: str | Path = DEFAULT_CORPUS) -> dict[str, list[dict]]:
    """Each task's rows: ``n`` held-out examples each (deterministic in ``n``, ``seed`` and the corpus)."""
    rng = random.Random(f"demo-harness:{seed}")
    choice = []
    for pair in build_pairs(n, seed=seed, corpus_path=corpus_path, split="val"):
        choices = [pair["chosen"], pair["rejected"]]
        rng.shuffle(choices)
        prompt = pair["prompt"][0]["content"]
        choice.append({"prompt": prompt, "choices": choices, "label": choices.index(pair["chosen"])})
    examples = build_examples(n, seed=seed, corpus_path=corpus_path, split="val", short_share=1.0)
    answers = [{"prompt": r["messages"][0]["content"], "answer": r["answer"], "task": r["task"]} for r in examples]
    speeches = [s for s in load_corpus(corpus_path).pool("val").speeches if len(s.lines) >= 2][:n]
    passages = [{"text": f"{s.speaker}:\n" + "\n".join(s.lines)} for s in speeches]
    return {"lantern_demo_choice": choice, "lantern_demo_passages": passages, "lantern_demo_answers": answers}


def task_config(name: str, data: Path) -> dict:
    """lm-eval's config of demo task ``name`` over the rows in ``data`` (a JSON-lines file)."""
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        **TASKS[name],
        "metadata": {"version": 1.0},
    }


def write_harness_tasks(out_dir: str | Path, n: int = 200, *, seed: int = 0, yamls: bool = True) -> Path:
    """``out_dir``: each task's rows (``NAME.jsonl``) and, with ``yamls``, its lm-eval YAML naming them by absolute
    path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in harness_rows(n, seed=seed).items():
        data = out / f"{name}.jsonl"
        write_atomically(data, "".join(json.dumps(row) + "\n" for row in rows).encode())
        if yamls:
            config = yaml.safe_dump(task_config(name, data), sort_keys=False)
            write_atomically(out / f"{name}.yaml", config.encode())
    return out


def demo_task_config(name: str) -> dict:
    """The built-in demo task ``name`` (200 examples, seed 0): its rows are written once, under a key of the corpus
    and the task definitions, to ``$XDG_CACHE_HOME/lantern`` (default ``~/.cache/lantern``)."""
    key = hashlib.sha256(DEFAULT_CORPUS.read_bytes() + json.dumps(TASKS, sort_keys=True).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lantern" / f"demo-tasks-{key}"
    data = cache / f"{name}.jsonl"
    if not data.is_file():  # the same bytes in every process: concurrent writers replace them atomically
        write_harness_tasks(cache, yamls=False)
    return task_config(name, data)
