"""The suite's warm ``lantern`` (tests/warm_cli.py) answers as a new ``python -m alignment.commands.cli`` process
does: the same exit status and output, the run's own environment and session, and a run past its timeout killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, run_lantern, subprocess_env

TINY = str(ROOT / "configs/pretrain/tiny.yaml")


def cold(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "alignment.commands.cli", *args]
    return subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args",
    [
        ("pretrain", TINY, "trainer.max_stepz=3"),  # a one-line error, exit 2
        ("-v", "pretrain", TINY, "trainer.max_steps=-3"),  # --verbose: the traceback, exit 1
        ("--help",),
    ],
    ids=["config-error", "traceback", "help"],
)
def test_a_warm_run_answers_as_a_new_process(args):
    warm, new = run_lantern(*args, timeout=300), cold(*args)
    assert (warm.returncode, warm.stdout) == (new.returncode, new.stdout)
    assert warm.stderr.splitlines()[-1:] == new.stderr.splitlines()[-1:]
    assert ("Traceback" in warm.stderr) == ("Traceback" in new.stderr)


def test_a_warm_run_has_its_own_environment_session_and_main_module():
    """A wrapper module (as the fault tests' are) runs as __main__ with the run's variables, arguments and working
    directory, leading its session; an environment that differs where libraries read it at import starts a new
    process instead."""
    probe = "tests.warm_cli_probe"
    warm = run_lantern("a", "b", module=probe, env=subprocess_env(LANTERN_PROBE="1"), timeout=120)
    assert warm.returncode == 0, warm.stderr
    expected = {"main": ["__main__", probe], "leads_session": True, "args": ["a", "b"], "cwd": str(ROOT)}
    answer = json.loads(warm.stdout)
    assert answer.pop("parent") not in (os.getpid(), 1)  # the warm server
    assert answer == {**expected, "variable": "1"}
    cold_env = subprocess_env(LANTERN_PROBE="2", TORCHINDUCTOR_CACHE_DIR="/nonexistent")
    other = run_lantern("a", "b", module=probe, env=cold_env, timeout=120)
    assert json.loads(other.stdout) == {**expected, "variable": "2", "parent": os.getpid()}  # a new process


def test_a_warm_run_past_its_timeout_is_killed_with_its_session():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_lantern("sleep", module="tests.warm_cli_probe", timeout=3)
    assert time.monotonic() - start < 30
    assert run_lantern("--help").returncode == 0  # the server goes on
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True)
    assert not left.stdout.strip(), left.stdout


def test_runs_stay_warm_when_this_process_environment_moves_on(monkeypatch, tmp_path):
    """In CI every run after the worker's first compile went cold: inductor had set TORCHINDUCTOR_CACHE_DIR here."""
    assert run_lantern("--help").returncode == 0
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # as inductor does when it first compiles here
    answer = json.loads(run_lantern(module="tests.warm_cli_probe").stdout)
    assert answer["parent"] not in (os.getpid(), 1)  # a warm server's child
