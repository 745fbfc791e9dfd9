"""A warm ``lantern`` for the suite: ``python -m alignment.commands.cli ARGS`` without paying the imports again.

A cold ``lantern`` process spends most of a tiny run importing (torch, Lightning and what Lightning imports: 7.8 of
11.4 s for an 8-step tiny pretraining run on 2 cores). The server (``python -m tests.warm_cli``, one per pytest
worker, started at its first run) imports what every stage's run imports, then forks one child per run. The child
is what ``python -m alignment.commands.cli ARGS`` (or a test's wrapper of it: ``module``) started with
``start_new_session=True`` would be from its first line on: its own session, the run's environment and working
directory, stdin from /dev/null, stdout and stderr to files, fresh Python RNG state, the module run as ``__main__``
(so Lightning relaunches other ranks as ``-m MODULE``), and the interpreter's own exit: a return code,
``SystemExit``, or a traceback and 1.

A run whose environment differs from the server's in a variable a library may read at import (anything but
``WANDB_*``, ``LANTERN_*``, ``PYTEST_*`` and ``PL_*``) runs cold, as a new process. Protocol: one JSON line per
request on the server's stdin, one JSON line in answer once the child ended: its exit status, or that the server
killed its session at the request's timeout.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = "alignment.commands.cli"
# read at run time, not when a module is imported: a run may set them without going cold
RUN_TIME_VARIABLES = ("WANDB_", "LANTERN_", "PYTEST_", "PL_")  # PL_: Lightning's seed_everything sets them


def import_time_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` less the variables read only at run time."""
    return {key: value for key, value in env.items() if not key.startswith(RUN_TIME_VARIABLES)}


def _child(request: dict) -> None:
    """In the forked child: become ``python -m MODULE ARGS``; never returns (SystemExit or an error
    reaches the interpreter, which exits as that process would)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for source, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(source, target)
        os.close(source)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    random.seed()  # a new process draws fresh entropy; a fork would repeat the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    module = request["module"]
    sys.argv = [module, *request["args"]]
    sys.modules.pop(module, None)  # as in a new process, where the module runs as __main__ only
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve() -> None:
    """Import what the stages' runs import, then run each request on stdin in a forked child."""
    import lightning  # noqa: F401

    import alignment.commands.cli  # noqa: F401
    from alignment.stages import registry

    for stage in registry.STAGES:
        stage.schema, stage.recipe  # noqa: B018 (imports the stage's modules)
    answer = sys.stdout
    answer.write(json.dumps({"ready": os.getpid()}) + "\n")
    answer.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        timed_out = _wait(pid, request["timeout"])
        _, status = os.waitpid(pid, 0)
        answer.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out}) + "\n")
        answer.flush()


def _wait(pid: int, timeout: float) -> bool:
    """Wait for child ``pid`` to end (not reaping it); past ``timeout`` seconds kill its session and say so."""
    ended = os.pidfd_open(pid)  # readable once the process has ended
    try:
        if select.select([ended], [], [], timeout)[0]:
            return False
    finally:
        os.close(ended)
    os.killpg(pid, signal.SIGKILL)
    return True


def _run_cold(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``command`` in a new process and session, as a warm run is: its output captured, its session killed past
    ``timeout``."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


class WarmCLI:
    """The client: one server process, started on first use; ``run`` is ``subprocess.run`` of the CLI."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.server: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_cli"],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        ready = server.stdout.readline()
        assert ready.startswith('{"ready"'), f"the warm CLI server did not start (exit {server.wait()})"
        return server

    def run(
        self, args: list[str], env: dict[str, str], timeout: float, module: str = CLI
    ) -> subprocess.CompletedProcess:
        """``python -m MODULE ARGS`` from the repository root with ``env`` in a session of its own, its output
        captured; a new process where ``env`` differs from the server's at import; killed (its session) past
        ``timeout``."""
        command = [sys.executable, "-m", module, *args]
        if import_time_environment(env) != import_time_environment(self.env):
            return _run_cold(command, env, timeout)
        if self.server is None or self.server.poll() is not None:
            self.server = self._start()
        with tempfile.TemporaryDirectory(prefix="warm-cli-") as folder:
            stdout, stderr = Path(folder, "stdout"), Path(folder, "stderr")
            request = {
                "module": module,
                "args": args,
                "env": env,
                "cwd": str(ROOT),
                "stdout": str(stdout),
                "stderr": str(stderr),
                "timeout": timeout,
            }
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            line = self.server.stdout.readline()
            assert line, f"the warm CLI server ended (exit {self.server.wait()})"
            answer = json.loads(line)
            if answer["timed_out"]:
                raise subprocess.TimeoutExpired(
                    command, timeout, stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
                )
            return subprocess.CompletedProcess(
                command, answer["returncode"], stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
            )

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()  # the server ends at the end of its input
            self.server.wait(timeout=30)


if __name__ == "__main__":
    serve()
