"""Ranks spawned by the multi-process tests (``tests.helpers.spawn_ranks``, issue 31).

Before, the FSDP2 compiled-decode test failed once in CI: ``mp.spawn`` said "process 0 terminated with signal
SIGABRT", with no Python error, and the test passed alone. After an FSDP2 forward torch keeps the process group
alive past ``destroy_process_group`` (its gloo and TCPStore threads still run), so it is torn down while the
interpreter exits, where such teardown can abort the process (pytorch/pytorch#190489, #90848). Now a rank whose work
returned leaves without that teardown, and a rank that fails is named with its signal and its output.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import spawn_ranks

pytestmark = pytest.mark.slow  # spawned processes


def _write_then_abort_at_exit(rank: int, out_dir: str) -> None:
    """A rank whose work passed, and whose interpreter teardown aborts it, as torch's process-group threads can."""
    Path(out_dir, f"rank{rank}.done").write_text("done")
    atexit.register(os.abort)


def _rank_0_aborts_rank_1_waits(rank: int) -> None:
    if rank == 0:
        print("rank 0 gives up here", file=sys.stderr, flush=True)
        os.abort()
    time.sleep(300)  # as a rank waiting in a collective for its dead peer


def _hangs(rank: int) -> None:
    time.sleep(300)


def test_a_rank_whose_work_returned_is_not_failed_by_the_interpreter_teardown(tmp_path):
    spawn_ranks(_write_then_abort_at_exit, (str(tmp_path),), world=2, log_dir=tmp_path, timeout=300)
    assert sorted(p.name for p in tmp_path.glob("*.done")) == ["rank0.done", "rank1.done"]


def test_a_rank_killed_by_a_signal_is_named_with_its_output_and_the_others_are_stopped(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        spawn_ranks(_rank_0_aborts_rank_1_waits, (), world=2, log_dir=tmp_path, timeout=600)
    message = str(failure.value)
    assert "rank 0: killed by SIGABRT" in message and "rank 0 gives up here" in message, message
    assert "Fatal Python error: Aborted" in message, message  # where it was: faulthandler's stacks
    assert "rank 1: killed: a rank failed" in message, message
    assert time.monotonic() - start < 240  # not rank 1's 300 s, nor the 600 s timeout


def test_a_rank_still_running_at_the_timeout_is_killed_and_named(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        spawn_ranks(_hangs, (), world=2, log_dir=tmp_path, timeout=5)
    message = str(failure.value)
    assert "rank 0: still running after 5 s" in message and "rank 1: still running after 5 s" in message, message
    assert time.monotonic() - start < 60  # the ranks killed, not waited for (300 s)
