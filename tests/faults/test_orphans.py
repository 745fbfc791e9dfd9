"""What a process killed with ``kill -9`` (as the OOM killer does) leaves behind: no lock held on its behalf, no worker
still running, and no temporary that the next run of the same command does not remove.

- ``lantern prepare`` with ``num_proc`` workers, killed while they tokenize: the workers die with it and the data
  folder's lock is free (a real process, through ``DRIVER``, whose workers say they run and then wait to be killed).
- a folder lock of a process whose forked child outlives it: free (the child never held it); a lock somebody else
  holds on behalf of a dead process: the refusal names who holds it.
- ``lantern convert`` killed while writing: its ``.DST.tmp-PID-TOKEN`` folder is removed by the next convert to the
  same destination; a live writer's temporaries and files that are not Lantern's temporaries are never touched.

Every wait has a deadline; nothing here races a timer.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from alignment.commands.cli import main as lantern
from models.files.folders import LOCK_FILE, FolderInUse, lock_folder, release_folder
from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/pretrain/tiny.yaml")
MARKERS = "LANTERN_TEST_MARKERS"  # the folder where DRIVER's stand-ins say they run, one file per process
START_TIMEOUT = 180  # for the command to start and reach its workers (imports are slow on a busy machine)
DEATH_TIMEOUT = 20  # for the processes a kill leaves to end (a death signal: immediate)

# ``lantern ARGS`` with prepare's tokenizer and the safetensors writer replaced by stand-ins that mark their process
# and wait to be killed (dill sends the function to datasets' workers by reference: this module is importable there).
DRIVER = """
import sys
import data.pretrain.prepare
import models.formats.checkpoint_io
from tests.faults.test_orphans import mark_and_wait
data.pretrain.prepare._tokenize_batch = mark_and_wait
models.formats.checkpoint_io.save_file = mark_and_wait
from alignment.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def mark_and_wait(*args: object, **kwargs: object) -> None:
    """DRIVER's stand-in: a file named by this process's pid says it runs; then it waits to be killed."""
    (Path(os.environ[MARKERS]) / f"process-{os.getpid()}").touch()
    time.sleep(START_TIMEOUT)
    raise RuntimeError("mark_and_wait was not killed")


def write_corpus(path: Path, paragraphs: int = 200) -> Path:
    path.write_text("".join(f"paragraph {i}: the king is dead, long live the queen.\n\n" for i in range(paragraphs)))
    return path


@contextlib.contextmanager
def driven(args: list[str], markers: Path, stderr: Path) -> Iterator[subprocess.Popen]:
    """``lantern *args`` through DRIVER, in its own session (its process group: every process it starts); on the way
    out, whatever of the group is left is killed."""
    markers.mkdir()
    with open(stderr, "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-c", DRIVER, *args],
            cwd=ROOT,
            env=subprocess_env(**{MARKERS: str(markers)}),
            stdout=err,
            stderr=err,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the old behaviour's orphans, so that nothing outlives the test
        process.wait(timeout=DEATH_TIMEOUT)


def wait_for_markers(process: subprocess.Popen, markers: Path, count: int, stderr: Path) -> list[int]:
    """The pids of the first ``count`` processes that reached a stand-in, once they have."""
    deadline = time.monotonic() + START_TIMEOUT
    while len(found := list(markers.iterdir())) < count:
        assert process.poll() is None, f"exited {process.returncode} early:\n{stderr.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {count} workers in {START_TIMEOUT}s:\n{stderr.read_text()[-3000:]}"
        time.sleep(0.05)
    return sorted(int(path.name.split("-")[1]) for path in found)


def living_in_group(group: int) -> list[int]:
    """Processes of process group ``group`` that still run (a zombie waiting to be reaped does not)."""
    living = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if entry.name.isdigit() and int(fields[2]) == group and fields[0] != "Z":
                living.append(int(entry.name))
    return living


def wait_until_group_ends(group: int) -> list[int]:
    """[] once every process of ``group`` ended, else those still running at the deadline."""
    deadline = time.monotonic() + DEATH_TIMEOUT
    while (living := living_in_group(group)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return living


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from Linux's /proc")


# --------------------------------------------------------------------------------------------------
# prepare's workers and the folder lock


@needs_proc
def test_kill_9_of_prepare_ends_its_workers_and_frees_the_data_folder(tmp_path):
    corpus, out = write_corpus(tmp_path / "corpus.txt"), tmp_path / "data"
    args = ["prepare", TINY, f"data.source=[{corpus}]", f"data.out_dir={out}", "data.num_proc=2"]
    stderr = tmp_path / "prepare.err"
    with driven(args, tmp_path / "markers", stderr) as process:
        workers = wait_for_markers(process, tmp_path / "markers", 2, stderr)
        assert process.pid not in workers  # they are datasets' worker processes, tokenizing
        process.send_signal(signal.SIGKILL)  # the main process only, as the OOM killer does
        process.wait(timeout=DEATH_TIMEOUT)
        assert wait_until_group_ends(process.pid) == [], "processes outlived the killed prepare"
    lock_folder(out, what="data folder", hint="")  # FolderInUse if anything held it on the dead one's behalf
    release_folder(out)
    assert lantern(["prepare", TINY, f"data.source=[{corpus}]", f"data.out_dir={out}", "data.num_proc=2"]) == 0
    assert (out / "manifest.json").is_file() and not list(out.glob(".prepare-*"))


LOCK_THEN_FORK = """
import os, sys, time
from pathlib import Path
from models.files.folders import lock_folder
lock_folder(Path(sys.argv[1]), what="run folder", hint="")
child = os.fork()
if child == 0:
    print("forked", flush=True)  # fork() has returned here: the child's at-fork hooks (closing the lock) have run
    time.sleep(120)  # a worker that outlives its parent
    os._exit(0)
print(child, flush=True)
time.sleep(120)
"""


@needs_proc
def test_a_folder_lock_ends_with_its_holder_not_with_the_children_it_forked(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_THEN_FORK, str(folder)],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lines = {holder.stdout.readline().strip() for _ in range(2)}  # the holder's and its child's, in either order
        child = int((lines - {"forked"}).pop())  # the holder prints it once the lock is held and the child forked
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=DEATH_TIMEOUT)
        assert living_in_group(holder.pid) == [child]  # the child lives on...
        lock_folder(folder, what="run folder", hint="")  # ...and holds no lock
        release_folder(folder)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)


HOLD_FOR = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": int(sys.argv[2]), "host": sys.argv[3], "started": "then"}).encode())
print("held", flush=True)
time.sleep(120)
"""


@needs_proc
def test_a_lock_held_on_behalf_of_a_dead_process_names_who_holds_it(tmp_path):
    """What an older Lantern's orphaned workers left: the lock names a process that died, another one holds it."""
    folder = tmp_path / "data"
    folder.mkdir()
    dead = dead_pid()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_FOR, str(folder / LOCK_FILE), str(dead), socket.gethostname()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUse) as refused:
            lock_folder(folder, what="data folder", hint="then run again")
        message = str(refused.value)
        named = f"process {holder.pid}, started by process {dead} on host {socket.gethostname()} (since then)"
        assert f"in use by {named}, which has died; end it (kill {holder.pid}): then run again" in message, message
    finally:
        holder.kill()
        holder.wait(timeout=DEATH_TIMEOUT)
    lock_folder(folder, what="data folder", hint="")
    release_folder(folder)


# --------------------------------------------------------------------------------------------------
# convert's temporaries


@pytest.fixture
def native(tmp_path) -> Path:
    import torch

    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.checkpoint import save_checkpoint
    from models.model import ModelConfig, Transformer

    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=64)
    )
    return save_checkpoint(model, tmp_path / "models" / "native", tokenizer_path=Tokenizer.load("default").path)


def test_a_convert_removes_what_a_killed_convert_to_the_same_destination_left(native, tmp_path):
    out = tmp_path / "exports" / "hf"
    stderr = tmp_path / "convert.err"
    with driven(["convert", str(native), "--to", "hf", str(out)], tmp_path / "markers", stderr) as process:
        wait_for_markers(process, tmp_path / "markers", 1, stderr)  # inside the temporary folder, writing weights
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=DEATH_TIMEOUT)
    (left,) = out.parent.glob(".hf.tmp-*")
    assert left.name.startswith(f".hf.tmp-{process.pid}-")
    # beside it: a user's file named like a temporary, and another convert's folder still being written by a writer
    # on another host sharing the disk (its pid means nothing here, its lock is held)
    user_file = out.parent / ".hf.tmp-notes"
    user_file.write_text("mine")
    live = out.parent / f".hf.tmp-{dead_pid()}-0123abcd"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert lantern(["convert", str(native), "--to", "hf", str(out)]) == 0
    finally:
        os.close(fd)
    assert not left.exists() and user_file.read_text() == "mine" and live.is_dir()
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([".hf.tmp-notes", live.name, "hf"])


def test_a_gguf_write_removes_only_dead_writers_temporaries(native, tmp_path):
    out = tmp_path / "model.gguf"
    dead, token = dead_pid(), "89abcdef"
    leftovers = [out.with_name(f".tmp-model.gguf.{dead}-{token}"), out.with_name(f".model.gguf.tmp-{dead}-{token}")]
    kept = [
        out.with_name(f".tmp-model.gguf.{os.getpid()}-{token}"),  # a live writer (this process)
        out.with_name(f".tmp-model.gguf.{dead}-{token}.part"),  # not a name Lantern writes
        out.with_name(f".tmp-other.gguf.{dead}-{token}"),  # another destination's
        out.with_name(f".model.gguf.old-{dead}-{token}"),  # without model.gguf, the only copy of the previous one
    ]
    for path in leftovers + kept:
        path.write_bytes(b"half")
    assert lantern(["convert", str(native), "--to", "gguf", str(out)]) == 0
    assert out.is_file() and not any(p.exists() for p in leftovers) and all(p.exists() for p in kept)


def test_leftovers_need_a_dead_writer_and_a_free_lock(tmp_path):
    from models.files.atomic import remove_leftovers

    target = tmp_path / "final"
    dead = dead_pid()
    gone = tmp_path / f".final.tmp-{dead}-00000000"
    locked = tmp_path / f".final.tmp-{dead}-11111111"
    for path in (gone, locked):
        path.mkdir()
    (gone / "model.safetensors").write_bytes(b"x" * 1000)
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_leftovers(target) == [gone]
    finally:
        os.close(fd)
    assert [p.name for p in tmp_path.iterdir()] == [locked.name]
