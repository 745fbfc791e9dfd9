"""The tools an RL episode may call (alignment/shared/tools.py): the calculator's exact arithmetic and its refusals,
tool calls read from the model's text (a malformed one is an observation), and the Python executor against each
attack the issue names: an infinite loop, a fork bomb, a huge print, deleting files through os, and more. Every
attack ends as text the model reads, in bounded time, with nothing outside the tool's folder touched."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from alignment.shared.tools import (
    CALCULATOR,
    TOOLS,
    ToolCall,
    calculate,
    format_number,
    parse_tool_calls,
    run_python,
    run_tool_call,
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("17 * 23", "391"),
        ("(17 * 23) - 4 / 5", "390.2"),
        ("0.1 + 0.2", "0.3"),  # exact, not 0.30000000000000004
        ("1 / 3", "1/3 (≈ 0.333333333333)"),
        ("-7 // 2", "-4"),
        ("7 % -3", "-2"),
        ("2 ** 100", str(2**100)),
        ("2 ^ 10", "1024"),
        ("2 ** -2", "0.25"),
        ("123456789123456789 * 987654321987654321", str(123456789123456789 * 987654321987654321)),
        ("-0.05 * 3", "-0.15"),
    ],
)
def test_the_calculator_is_exact(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("1 / 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "exponents must be whole numbers up to"),
        ("99 ** 1000", "more than 1000 digits"),
        ("2 ** 0.5", "exponents must be whole numbers"),
        ("__import__('os').system('ls')", "only numbers"),
        ("x + 1", "only numbers"),
        ("1 +", "is not an arithmetic expression"),
        ("1" * 300, "at most 200 characters"),
    ],
)
def test_the_calculator_refuses_in_one_line(expression, problem):
    answer = calculate(expression)
    assert answer.startswith("error: ") and problem in answer and "\n" not in answer


def test_terminating_decimals_are_written_exactly():
    assert format_number(Fraction(1, 8)) == "0.125" and format_number(Fraction(-3, 40)) == "-0.075"


def test_tool_calls_are_read_from_the_models_text_and_a_malformed_one_is_an_observation():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
        "<tool_call>{name: calculator}</tool_call>"
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2'
    )
    calls = parse_tool_calls(text)
    assert [call.name for call in calls] == ["calculator", "calculator", "", "search", "calculator", ""]
    observations = [run_tool_call(call, TOOLS) for call in calls]
    assert observations[:2] == ["42", "2"]
    assert observations[2].startswith("error: the tool call is not JSON")
    assert observations[3] == "error: no tool named 'search'; the tools are calculator, python"
    assert observations[4] == 'error: calculator takes {"expression": "..."}'
    assert observations[5].startswith("error: the tool call is not JSON")  # cut before its closing tag
    assert parse_tool_calls("no call here") == []
    assert run_tool_call(ToolCall(error="x"), TOOLS) == "error: x"


def test_a_tool_is_given_to_chat_templates_in_the_function_format():
    schema = CALCULATOR.schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_python_runs_a_program_and_returns_what_it_prints():
    assert run_python("print(sum(range(10)))") == "45\n"
    assert run_python("open('scratch.txt', 'w').write('ok'); print(open('scratch.txt').read())") == "ok\n"
    failed = run_python("1 / 0")
    assert "ZeroDivisionError" in failed and failed.endswith("[exit code 1]")


def timed(code: str, **limits) -> tuple[str, float]:
    start = time.monotonic()
    answer = run_python(code, **limits)
    return answer, time.monotonic() - start


def test_an_infinite_loop_is_stopped_at_the_time_limit():
    answer, seconds = timed("while True:\n    pass", timeout_s=1)
    assert answer.endswith("[stopped: time limit of 1 s]") and seconds < 10


def test_a_fork_bomb_starts_no_process():
    answer, seconds = timed("import os\nwhile True:\n    os.fork()")
    assert seconds < 10
    assert "PermissionError: os.fork is not allowed here" in answer and answer.endswith("[exit code 1]")
    for spawn in ("import subprocess", "import os; os.system('true')", "import os; os.execv('/bin/true', ['true'])"):
        assert "is not allowed here" in run_python(spawn), spawn


def test_a_huge_print_is_cut_and_stopped():
    answer, seconds = timed("while True:\n    print('x' * 1000)", max_output=2000)
    assert answer.endswith("[stopped: output over 2000 bytes]") and len(answer) < 2100 and seconds < 10
    answer = run_python("print('y' * 10**6)", max_output=100)
    assert answer.startswith("y" * 100) and "[stopped: output over 100 bytes]" in answer


def test_deleting_or_writing_files_outside_the_tools_folder_is_refused(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("mine")
    for program in (
        f"import os; os.remove({str(victim)!r})",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
        f"open({str(victim)!r}, 'w').write('gone')",
        f"import os; os.rename({str(victim)!r}, 'stolen.txt')",
        f"import os; os.open({str(tmp_path / 'new.txt')!r}, os.O_WRONLY | os.O_CREAT)",
    ):
        answer = run_python(program)
        assert "PermissionError" in answer and "not allowed here" in answer, program
    assert victim.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_no_network_no_native_code_and_bounded_memory():
    for program in ("import socket", "import ctypes", "import multiprocessing"):
        assert "not allowed here" in run_python(program), program
    answer = run_python("x = bytearray(2 * 1024**3)", memory_mb=256)
    assert "MemoryError" in answer and answer.endswith("[exit code 1]")
