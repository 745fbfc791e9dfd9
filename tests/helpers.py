"""Helpers the test modules share (the shared fixtures are in tests/conftest.py)."""

from __future__ import annotations

import atexit
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch

from tests.warm_cli import WarmCLI, import_time_environment

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "the",
    "king",
    "is",
    "dead",
    "long",
    "live",
    "queen",
    "of",
    "england",
    "and",
    "thou",
    "art",
    "my",
    "lord",
    "good",
    "night",
    "sweet",
    "prince",
]


def family_block(architecture: str) -> dict:
    """ModelConfig options that make a model of the family ``architecture`` (its record's own block options)."""
    from models.families import family_of

    return {"hf_architecture": architecture, **family_of(architecture).block}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


class CaptureGradients(L.Callback):
    """Copies every gradient of `pl_module.model` just before the first optimizer step."""

    def __init__(self) -> None:
        self.gradients: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.gradients:
            self.gradients = {
                n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters() if p.grad is not None
            }


# torch.distributed's rendezvous variables: a value left in this process by an in-process test must never
# reach a child, or its ranks would meet at a stale port (once: EADDRINUSE on one rank, the other waiting).
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this one's without rendezvous variables, the repository on
    PYTHONPATH, one OpenMP thread per process (two ranks on two cores; kernels take the same path each run),
    inductor compiling in-process (no pool of compile workers per rank), plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    env.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=str(ROOT))
    return {**env, **extra}


_warm_cli: WarmCLI | None = None


def run_lantern(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, module: str = "alignment.commands.cli"
) -> subprocess.CompletedProcess:
    """``python -m MODULE *args`` from the repository root (``subprocess_env()`` unless ``env``) in a session of its
    own, its output captured, as ``subprocess.run`` gives it: forked from this worker's warm CLI server
    (tests/warm_cli.py), which paid the imports once. ``module``: the CLI, or a test's wrapper of it."""
    global _warm_cli
    base = subprocess_env()
    if _warm_cli is None or import_time_environment(_warm_cli.env) != import_time_environment(base):
        # this process's own environment moved on (inductor sets TORCHINDUCTOR_CACHE_DIR when it first compiles
        # here): a server started from the new one, so that runs with it stay warm
        if _warm_cli is not None:
            _warm_cli.close()
        _warm_cli = WarmCLI(base)
        atexit.register(_warm_cli.close)
    return _warm_cli.run(list(args), env or base, timeout, module)


def run_command(
    command: list[str], env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``command``, written ``[sys.executable, "-m", MODULE, *args]``, through ``run_lantern``."""
    executable, option, module, *args = command
    assert (executable, option) == (sys.executable, "-m"), command
    return run_lantern(*args, env=env, timeout=timeout, module=module)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``run_lantern(*args)``, which must succeed (the assertion shows the end of its stderr)."""
    result = run_lantern(*args)
    assert result.returncode == 0, result.stderr[-5000:]
    return result


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` while inside: a spawned process starts with the environment of that moment."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _rank_main(rank: int, target: Callable[..., None], args: tuple, log: str, env: dict[str, str]) -> None:
    """One rank: the environment ``env``, its stdout and stderr into ``log`` (with Python's stacks on a fatal
    signal), then ``target(rank, *args)``; exits 0 once it returned, 1 with the traceback in ``log`` if it raised."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)
    code = 0
    try:
        target(rank, *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # The rank's outcome is settled; the interpreter's teardown could only change it. After an FSDP2 forward torch
    # keeps the process group alive past destroy_process_group (DTensor specs hold its DeviceMesh): its gloo worker
    # and TCP threads, and rank 0's TCPStore server, still run when the interpreter exits, and their C++ teardown
    # there can abort the process (pytorch/pytorch#190489, #90848): SIGABRT, no Python error, after a pass.
    os._exit(code)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def spawn_ranks(target: Callable[..., None], args: tuple, world: int, log_dir: Path, timeout: float) -> None:
    """Run ``target(rank, *args)`` for each rank in its own process (``subprocess_env``), as ``mp.spawn`` does, each
    rank's output in ``log_dir/rank{N}.log``. The processes come from multiprocessing's fork server, which imported
    torch and Lightning once per pytest worker (a spawned rank paid about 6 s importing them). Fails, naming every
    rank that did not exit 0 (its exit code or signal) with the end of its log, once one fails (the others are
    killed then: they would wait for it in a collective until gloo's 30-minute timeout) or when any still runs after
    ``timeout`` seconds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "lightning", "tests.helpers"])  # before the server's first start
    logs = [Path(log_dir, f"rank{rank}.log") for rank in range(world)]
    env = subprocess_env()
    processes = [
        context.Process(target=_rank_main, args=(rank, target, args, str(logs[rank]), env), name=f"rank{rank}")
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout
    killed = []
    try:
        with _environment(env):  # the fork server's, when this starts it
            for process in processes:
                process.start()
        while time.monotonic() < deadline and any(p.exitcode is None for p in processes):
            running = [p for p in processes if p.exitcode is None]
            ready = multiprocessing.connection.wait([p.sentinel for p in running], deadline - time.monotonic())
            for process in running:
                if process.sentinel in ready:
                    process.join()  # it is exiting: wait for its exit code
            if any(p.exitcode not in (None, 0) for p in processes):
                break
    finally:
        for process in (p for p in processes if p.pid is not None):  # started
            if process.exitcode is None:
                process.kill()
                killed.append(process)
            process.join()
    why_killed = f"still running after {timeout:g} s" if time.monotonic() >= deadline else "killed: a rank failed"
    reasons = [
        why_killed if p in killed and p.exitcode == -signal.SIGKILL else _exit_reason(p.exitcode) for p in processes
    ]
    report = [
        f"rank {rank}: {reason}; the end of {logs[rank]}:\n"
        + (logs[rank].read_text(errors="replace")[-4000:] if logs[rank].exists() else "(no log)")
        for rank, reason in enumerate(reasons)
        if reason != _exit_reason(0)
    ]
    assert not report, "\n".join(report)


def write_gpt2_gguf(path: Path) -> Path:
    """A one-tensor GGUF file of the gpt2 architecture, which Lantern does not read."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_transformers_loads(folder: Path, model: torch.nn.Module, tokenizer, text: str = "ROMEO: But soft!") -> None:
    """``folder`` (a model folder Lantern wrote) loads in transformers as it is: ``AutoModelForCausalLM`` gives the
    logits of ``model`` (Lantern's load of it) within 1e-4, and ``AutoTokenizer`` encodes ``text`` into the ids of
    ``tokenizer`` (Lantern's), bos included when the model's tokenizer adds one."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = hf_tokenizer(text)["input_ids"]
    ours = tokenizer.encode(text)
    assert ids in (ours, [tokenizer.bos_id, *ours]), (ids, ours)
    batch = torch.tensor([ids])
    with torch.no_grad():
        expected = model.float().eval()(batch)
        got = hf.eval()(batch).logits
    assert (got - expected).abs().max().item() <= 1e-4
