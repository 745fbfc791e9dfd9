"""The arithmetic tasks: right answers, a checker that wants the stated answer line, held-out questions never trained
on, the demo files' layout (so every stage reads them), and bad settings refused before any file is written."""

from __future__ import annotations

import json

import pytest

from data.demo.arithmetic import INSTRUCTION, OPERATIONS, example, write_arithmetic_dataset
from data.demo.scoring import score_example
from data.demo.tasks import load_jsonl
from models.errors import DataError


def test_each_question_states_the_format_and_its_demonstration_is_right():
    for task, (symbol, first, second, operation) in OPERATIONS.items():
        record = example(task, first[3], second[5])
        question = record["messages"][0]["content"]
        assert question == f"What is {first[3]} {symbol} {second[5]}? {INSTRUCTION}"
        assert record["messages"][1]["content"] == str(operation(first[3], second[5])) == record["answer"]
        assert score_example(record, record["answer"]) == 1.0


@pytest.mark.parametrize(
    "reply, score",
    [
        ("85", 1.0),
        ("37 + 48 = 85.", 1.0),  # working before the answer is allowed
        ("84, no: 85", 1.0),  # the last number counts
        ("85, or maybe 84", 0.0),
        ("The sum is eighty-five.", 0.0),
        ("37 + 48", 0.0),
        ("1,085", 0.0),
        ("", 0.0),
    ],
)
def test_the_checker_wants_the_right_number_last(reply, score):
    assert score_example(example("add", 37, 48), reply) == score


def test_the_checker_reads_thousands_separators_and_signs():
    assert score_example(example("multiply", 99, 9), "99 * 9 = 891") == 1.0
    assert score_example({"task": "add", "meta": {"answer": "1085"}}, "1,085") == 1.0
    assert score_example({"task": "subtract", "meta": {"answer": "-3"}}, "2 - 5 = -3") == 1.0


def test_files_have_the_demo_layout_held_out_questions_are_never_trained_on_and_a_rerun_is_a_no_op(tmp_path):
    paths = write_arithmetic_dataset(tmp_path / "a", n_train=90, n_val=60, n_pairs=30, seed=3)
    train, val = load_jsonl(paths["train"]), load_jsonl(paths["val"])
    prompts, train_prompts, pairs = (load_jsonl(paths[k]) for k in ("prompts", "train_prompts", "pairs"))
    assert (len(train), len(val), len(prompts), len(train_prompts), len(pairs)) == (90, 60, 60, 90, 30)
    assert [r["task"] for r in val[: len(OPERATIONS)]] == list(OPERATIONS)  # the tasks in turn
    key = lambda r: (r["task"], r["meta"]["a"], r["meta"]["b"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in val}
    assert all("messages" in r and r["messages"][-1]["role"] == "user" for r in prompts)
    for pair in pairs:
        assert score_example(pair, pair["chosen"]) == 1.0 and score_example(pair, pair["rejected"]) == 0.0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()}
    assert write_arithmetic_dataset(tmp_path / "a", n_train=90, n_val=60, n_pairs=30, seed=3) == paths
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()} == before
    other = write_arithmetic_dataset(tmp_path / "b", n_train=90, n_val=60, n_pairs=30, seed=4)
    assert load_jsonl(other["val"]) != val
    assert json.loads(paths["manifest"].read_text())["tasks"] == list(OPERATIONS)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"tasks": ["divide"]}, "arithmetic tasks must be some of ['add', 'add_small', 'subtract', 'multiply'], got"),
        ({"tasks": ["multiply"], "n_val": 720}, "n_val 720 leaves no training question for multiply"),
        ({"tasks": ["multiply"], "n_train": 700, "n_val": 100}, "n_train / n_pairs ask 700 multiply questions"),
    ],
)
def test_bad_settings_are_one_line_before_any_file(tmp_path, arguments, message):
    with pytest.raises(DataError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        write_arithmetic_dataset(tmp_path / "out", **{"n_train": 10, "n_val": 10, "n_pairs": 10, **arguments})
    assert not (tmp_path / "out").exists()


def test_tool_demonstrations_call_the_calculator_and_its_result_is_the_answer(tmp_path):
    """With the calculator's schema, SFT's demonstrations are transcripts the episode runner would make: the call as
    ``parse_tool_calls`` reads it, the calculator's own output, then the answer; the row offers the tool. The RL
    prompts and the held-out questions are the plain run's."""
    from alignment.shared.tools import CALCULATOR, TOOLS, parse_tool_calls, run_tool_call

    schema = CALCULATOR.schema()
    plain = write_arithmetic_dataset(str(tmp_path / "plain"), tasks=["multiply"], n_train=20, n_val=10, n_pairs=4)
    tools = write_arithmetic_dataset(
        str(tmp_path / "tools"), tasks=["multiply"], n_train=20, n_val=10, n_pairs=4, calculator=schema
    )
    for split in ("train", "val"):
        for record in load_jsonl(tools[split]):
            user, call, result, answer = record["messages"]
            assert record["tools"] == [schema] and [user["role"], call["role"], result["role"]] == [
                "user", "assistant", "tool"
            ]  # fmt: skip
            [parsed] = parse_tool_calls(call["content"])
            assert run_tool_call(parsed, TOOLS) == result["content"] == answer["content"] == record["answer"]
            assert score_example(record, answer["content"]) == 1.0
    for split in ("prompts", "train_prompts"):
        assert load_jsonl(tools[split]) == load_jsonl(plain[split])
