"""Arithmetic questions with a checker: verifiable tasks that a real instruct model (SmolLM2-135M-Instruct) gets
partly right, for the alignment experiments on it (docs/results.md).

    add           two 2-digit numbers               "What is 37 + 48? ..."   -> "85"
    add_small     a 1-digit and a 2-digit number    "What is 7 + 48? ..."    -> "55"
    subtract      a 2-digit minus a 1-digit number  "What is 52 - 7? ..."    -> "45"
    multiply      a 2-digit times a 1-digit number  "What is 23 * 7? ..."    -> "161"

Every question ends with the same instruction (``INSTRUCTION``), and ``data.demo.scoring`` scores a reply 1 when the
last number in it is the right one: working shown before it is allowed, a wrong or missing final number is not.
Each task's (a, b) pairs are shuffled once and split, so no held-out question is ever a training one. The files are
those of ``write_demo_dataset`` (SFT demonstrations answer with the number alone), so every stage and the pipeline
read them as they read the Shakespeare tasks (``demo.kind: arithmetic``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

from data.demo.tasks import check_demo_arguments, prompt_records, write_task_files
from models.errors import DataError

FORMAT_VERSION = "lantern-arithmetic-v1"
INSTRUCTION = "Reply with the number only."
OPERATIONS: dict[str, tuple[str, range, range, Callable[[int, int], int]]] = {
    "add": ("+", range(10, 100), range(10, 100), lambda a, b: a + b),
    "add_small": ("+", range(1, 10), range(10, 100), lambda a, b: a + b),
    "subtract": ("-", range(10, 100), range(1, 10), lambda a, b: a - b),
    "multiply": ("*", range(10, 100), range(2, 10), lambda a, b: a * b),
}


def example(task: str, a: int, b: int, calculator: dict[str, Any] | None = None) -> dict[str, Any]:
    """One question as a demo record: the user turn, the demonstration, the task and the number the checker wants.
    ``calculator`` (its schema): the demonstration calls it and answers with its result, and the row offers it."""
    symbol, _, _, operation = OPERATIONS[task]
    answer = str(operation(a, b))
    messages = [{"role": "user", "content": f"What is {a} {symbol} {b}? {INSTRUCTION}"}]
    record = {"task": task, "kind": "short", "answer": answer, "meta": {"answer": answer, "a": a, "b": b}}
    if calculator is None:
        return {"messages": [*messages, {"role": "assistant", "content": answer}], **record}
    name = calculator["function"]["name"]
    call = json.dumps({"name": name, "arguments": {"expression": f"{a} {symbol} {b}"}})
    messages += [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},  # as parse_tool_calls reads it
        {"role": "tool", "name": name, "content": answer},
        {"role": "assistant", "content": answer},
    ]
    return {"messages": messages, "tools": [calculator], **record}


def split_operands(task: str, n_val: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train pool, held-out) operand pairs of ``task``: all of them shuffled once, the first ``n_val`` held out."""
    _, first, second, _ = OPERATIONS[task]
    pairs = [(a, b) for a in first for b in second]
    random.Random(f"arithmetic:{seed}:{task}").shuffle(pairs)
    if n_val >= len(pairs):
        raise DataError(f"n_val {n_val} leaves no training question for {task} ({len(pairs)} in all)")
    return pairs[n_val:], pairs[:n_val]


def build_arithmetic(
    tasks: Sequence[str], n_train: int, n_val: int, n_pairs: int, seed: int, calculator: dict[str, Any] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The demo files' records: ``n_train`` and ``n_val`` questions and ``n_pairs`` preference pairs (the right answer
    against a near miss), spread evenly over ``tasks`` in turn; with ``calculator``, SFT's demonstrations call it."""
    pools = {task: split_operands(task, -(-n_val // len(tasks)), seed) for task in tasks}
    rng = random.Random(f"arithmetic-pairs:{seed}")

    def take(count: int, part: int) -> list[dict[str, Any]]:
        return [
            example(tasks[i % len(tasks)], *pools[tasks[i % len(tasks)]][part][i // len(tasks)]) for i in range(count)
        ]

    train, val = take(n_train, 0), take(n_val, 1)
    if calculator is not None:  # the same questions, demonstrated with the tool; prompts and pairs are unchanged
        with_tool = [example(r["task"], r["meta"]["a"], r["meta"]["b"], calculator) for r in (*train, *val)]
        sft_train, sft_val = with_tool[: len(train)], with_tool[len(train) :]
    else:
        sft_train, sft_val = train, val
    pairs = []
    for record in take(n_pairs, 0):
        right = int(record["meta"]["answer"])
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        pairs.append({
            "prompt": record["messages"][:1], "chosen": record["answer"], "rejected": str(wrong),
            "task": record["task"], "kind": "short", "meta": record["meta"],
        })  # fmt: skip
    return {
        "train": sft_train, "val": sft_val, "prompts": prompt_records(val), "train_prompts": prompt_records(train),
        "pairs": pairs,
    }  # fmt: skip


def write_arithmetic_dataset(
    out_dir: str,
    *,
    tasks: Sequence[str] = tuple(OPERATIONS),
    n_train: int = 4000,
    n_val: int = 600,
    n_pairs: int = 2000,
    seed: int = 0,
    refuse_other_settings: bool = False,
    key: str = "--out",
    calculator: dict[str, Any] | None = None,
) -> dict:
    """``write_demo_dataset``'s files for the arithmetic ``tasks`` (the same layout, manifest and no-op rerun);
    ``calculator``: the schema of the tool SFT's demonstrations call (``alignment.shared.tools.CALCULATOR``)."""
    check_demo_arguments(out_dir, n_train=n_train, n_val=n_val, n_pairs=n_pairs)
    unknown = [task for task in tasks if task not in OPERATIONS]
    if unknown or not tasks:
        raise DataError(f"arithmetic tasks must be some of {list(OPERATIONS)}, got {list(tasks)}")
    per_task = -(-max(n_train, n_pairs) // len(tasks))
    for task in tasks:  # enough training questions for the counts asked, before any file is touched
        if per_task > len(split_operands(task, -(-n_val // len(tasks)), seed)[0]):
            raise DataError(f"n_train / n_pairs ask {per_task} {task} questions; it has fewer outside the held-out")
    params = {
        "format": FORMAT_VERSION, "tasks": list(tasks), "n_train": n_train, "n_val": n_val, "n_pairs": n_pairs,
        "seed": seed, **({"calculator": calculator} if calculator is not None else {}),
    }  # fmt: skip
    build = lambda: build_arithmetic(list(tasks), n_train, n_val, n_pairs, seed, calculator)  # noqa: E731
    return write_task_files(out_dir, params, build, refuse_other_settings=refuse_other_settings, key=key)
