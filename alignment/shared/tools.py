"""Tools a policy may call in an RL episode, and the calls as its chat template writes them. Two tools ship: a
calculator (exact arithmetic over a small expression grammar) and a Python executor (a child process with time,
memory and output limits, no network, no processes, no writes outside its own temporary folder). A tool takes the
call's arguments and returns the text the model reads next; a malformed call, a bad argument or a hostile program is
that text, never an exception. Limits and what the sandbox does and does not stop: docs/tools.md.
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import os
import re
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does and its JSON-schema parameters (what transformers'
    ``apply_chat_template(tools=...)`` renders), and ``run(arguments) -> observation``."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[dict[str, Any]], str]

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's function format)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}  # fmt: skip

    def call(self, arguments: Any) -> str:
        """The observation for ``arguments``: the tool's text, or an error the model can read and correct."""
        required = self.parameters.get("required", [])
        if not isinstance(arguments, dict) or any(name not in arguments for name in required):
            return f"error: {self.name} takes {json.dumps({name: '...' for name in required})}"
        return self.run(arguments)


# ---- tool calls as SmolLM2 / Qwen-style templates write them: JSON between <tool_call> tags


TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and arguments, or why it could not be read (``error``)."""

    name: str = ""
    arguments: Any = field(default_factory=dict)
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, in order; one that is not
    such JSON (or is cut before its closing tag) comes back with its ``error``."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as problem:
            calls.append(ToolCall(error=f"the tool call is not JSON ({problem.msg} at character {problem.pos})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(error='a tool call is {"name": "...", "arguments": {...}}'))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                calls.append(ToolCall(value["name"], error="the tool call's arguments are not JSON"))
                continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


def run_tool_call(call: ToolCall, tools: dict[str, Tool]) -> str:
    """The observation a call gets: its tool's answer, or the error (a malformed call, an unknown tool)."""
    if call.error:
        return f"error: {call.error}"
    if call.name not in tools:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(tools))}"
    return tools[call.name].call(call.arguments)


# ---- the calculator: + - * / // % ** and parentheses over integers and decimals, exactly

MAX_EXPRESSION = 200  # characters
MAX_DIGITS = 1000  # of a result's numerator or denominator
MAX_EXPONENT = 1000
_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b), ast.Mod: operator.mod,
}  # fmt: skip


class CalculatorError(ValueError):
    pass


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))  # 0.1 is one tenth, not the nearest binary fraction
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _evaluate(node.left), _evaluate(node.right)
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        digits = len(str(max(abs(base.numerator), base.denominator)))
        if (digits - 1) * abs(exponent) > MAX_DIGITS:  # refused before it is computed: 99 ** 1000 has 1996 digits
            raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
        return _bounded(base ** int(exponent))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalculatorError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise CalculatorError("only numbers, + - * / // % ** and parentheses")


def _bounded(value: Fraction) -> Fraction:
    if max(abs(value.numerator), value.denominator) >= 10**MAX_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def format_number(value: Fraction) -> str:
    """An integer as itself; a fraction as its exact decimal when it ends, else as a/b with 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    if denominator == 1:  # a terminating decimal: scale to an integer and place the point
        places = max(twos, fives)
        digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
        return f"{'-' if value < 0 else ''}{digits[:-places]}.{digits[-places:]}"
    return f"{value.numerator}/{value.denominator} (≈ {float(value):.12g})"


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression, or ``error: ...``."""
    if len(expression) > MAX_EXPRESSION:
        return f"error: expressions are at most {MAX_EXPRESSION} characters"
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError:
        return f"error: {expression!r} is not an arithmetic expression"
    try:
        return format_number(_evaluate(tree))
    except CalculatorError as problem:
        return f"error: {problem}"


CALCULATOR = Tool(
    "calculator",
    "Evaluate an arithmetic expression exactly: integers and decimals, + - * / // % ** and parentheses.",
    {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. (17 * 23) - 4 / 5"}},
     "required": ["expression"]},
    lambda arguments: calculate(str(arguments["expression"])),
)  # fmt: skip


# ---- the Python executor

# Run in the child before the program: an audit hook (which no Python code can remove) refuses new processes,
# sockets, native code and any write, removal or rename outside the child's temporary folder.
_GUARD = r"""
import os, sys
HOME = os.path.realpath(os.getcwd()) + os.sep
REFUSED = {"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
           "os.kill", "os.killpg", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
           "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "os.setuid", "os.chroot"}
PATHS = {"os.remove", "os.rmdir", "os.rename", "os.truncate", "os.chmod", "os.chown", "os.link", "os.symlink",
         "os.mkdir", "shutil.rmtree", "os.utime", "os.replace"}
NATIVE = ("ctypes", "_ctypes", "cffi", "mmap", "_posixsubprocess", "multiprocessing", "socket", "_socket", "_ssl",
          "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_testcapi", "_testinternalcapi")
def inside(path):
    try:
        return os.path.realpath(os.fsdecode(path)).startswith(HOME)
    except (TypeError, ValueError):
        return False
def guard(event, args):
    if event in REFUSED:
        raise PermissionError(f"{event} is not allowed here")
    if event == "import" and args[0].split(".")[0] in NATIVE:
        raise PermissionError(f"import {args[0]} is not allowed here")
    if event in PATHS and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
        raise PermissionError(f"{event} outside the working folder is not allowed here")
    if event == "open" and args[1] is not None and any(c in str(args[1]) for c in "wax+") and not inside(args[0]):
        raise PermissionError("writing outside the working folder is not allowed here")
    if event == "open" and isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and not inside(args[0]):
        raise PermissionError("writing outside the working folder is not allowed here")
sys.addaudithook(guard)
del guard
source = open("program.py").read()
exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
"""


def _limits(memory_bytes: int, cpu_seconds: int) -> Callable[[], None]:
    def apply() -> None:
        os.setsid()  # its own process group: killed as one
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file over 1 MiB
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, max_output: int = 4096) -> str:
    """Run ``code`` in a fresh interpreter (``-I``, standard library only) inside a temporary folder that is removed
    afterwards; its stdout and stderr, cut at ``max_output`` bytes, then a line saying how it ended when it did
    not end well (an exit code, the time limit, the output limit)."""
    with tempfile.TemporaryDirectory(prefix="lantern-tool-") as folder:
        Path(folder, "program.py").write_text(code)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "HOME": folder}
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD], cwd=folder, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=_limits(memory_mb << 20, int(timeout_s) + 1),
        )  # fmt: skip
        output, stopped = _read_bounded(child, timeout_s, max_output)
        text = output[:max_output].decode("utf-8", errors="replace")
        if stopped:
            return f"{text}\n[stopped: {stopped}]"
        if child.returncode:
            return f"{text}\n[exit code {child.returncode}]"
        return text


def _read_bounded(child: subprocess.Popen, timeout_s: float, max_output: int) -> tuple[bytes, str]:
    """(what the child wrote, up to ``max_output`` + 1 bytes; why it was stopped, or ""): it is killed, with its
    process group, at the time limit or once it has written more than ``max_output`` bytes."""
    deadline, chunks, size, stopped = time.monotonic() + timeout_s, [], 0, ""
    stream = child.stdout
    assert stream is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            stopped = f"time limit of {timeout_s:g} s"
            break
        ready, _, _ = select.select([stream], [], [], left)
        if not ready:
            continue
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:  # the child closed its output: it is ending
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > max_output:
            stopped = f"output over {max_output} bytes"
            break
    if stopped:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    try:
        child.wait(timeout=max(deadline - time.monotonic(), 0) + 5)
    except subprocess.TimeoutExpired:  # closed its output but kept running
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        stopped = stopped or f"time limit of {timeout_s:g} s"
    stream.close()
    if child.returncode == -signal.SIGXCPU:
        stopped = stopped or f"time limit of {timeout_s:g} s"
    return b"".join(chunks), stopped


PYTHON = Tool(
    "python",
    "Run a short Python program (standard library only) and read what it prints; no files outside its own folder, "
    "no network, no processes, a few seconds at most.",
    {"type": "object", "properties": {"code": {"type": "string", "description": "the program; print the result"}},
     "required": ["code"]},
    lambda arguments: run_python(str(arguments["code"])),
)  # fmt: skip

TOOLS: dict[str, Tool] = {tool.name: tool for tool in (CALCULATOR, PYTHON)}
