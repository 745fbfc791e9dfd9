"""Several nodes as people launch them, on loopback: torchrun on every node, SLURM's ``srun`` (its variables set
by hand), a resume on another node count, and a node that dies or hangs mid-run.

Every process is a real ``lantern pretrain`` of the tiny preset (``tests/trainer/test_distributed.py``'s command),
gloo on this CPU. One global batch of 4 samples per step throughout (micro-batch 4 on one process, 2 on two, 1 on
four), so every layout trains on the same samples and ends where one process does. Outputs go to files: a rank
blocked on a full pipe would stall the others' collectives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.test_distributed import (
    ROOT,
    STEPS,
    assert_same_weights,
    command,
    environment,
    final_weights,
    free_port,
    run,
    train_losses,
    wait_for_checkpoint,
)
from trainer.checkpoints import latest_checkpoint

GLOBAL_BATCH = 4
HANG_TIMEOUT_S = 15  # trainer.collective_timeout_s of the hung-node tests (the default is 1800)


def per_rank(world_size: int) -> str:
    return f"loader.micro_batch_size={GLOBAL_BATCH // world_size}"


def two_nodes(strategy: str, devices: int = 1) -> tuple[str, ...]:
    # collective_timeout_s: a rank that fails stops the others in 2 minutes, not the default half hour
    return (
        f"trainer.strategy={strategy}", "trainer.num_nodes=2", f"trainer.devices={devices}", per_rank(2 * devices),
        "trainer.collective_timeout_s=120",
    )  # fmt: skip


def torchrun(node_rank: int, port: int, lantern: list[str]) -> list[str]:
    """The documented torchrun line for node ``node_rank`` of 2, one process per node (``-m`` for the console
    script: the same program without relying on PATH)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port), *lantern[1:],
    ]  # fmt: skip


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as handle:  # the child keeps its own descriptor
        return subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it: a node's processes (torchrun starts its workers in sessions of their
    own, so the agent's process group does not hold them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:  # exited meanwhile
            continue
        if stat:
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def signal_all(pids: list[int], how: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, how)


def kill_running(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            signal_all(process_tree(process.pid), signal.SIGKILL)  # SIGKILL ends a stopped process too
        process.wait()


def finish(processes: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> list[str]:
    """Wait for every process; all must succeed. Returns their outputs."""
    try:
        for process in processes:
            process.wait(timeout=timeout)
    finally:
        kill_running(processes)
    outputs = [log.read_text(errors="replace") for log in logs]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-5000:]
    return outputs


def assert_losses_match(run_dir: Path, reference: Path, steps: range, abs_: float) -> None:
    losses, expected = train_losses(run_dir), train_losses(reference)
    assert sorted(losses) == list(steps)
    for step in steps:
        assert losses[step] == pytest.approx(expected[step], abs=abs_), step


@pytest.fixture(scope="module")
def single(data_dir, tmp_path_factory) -> Path:
    """One process, micro-batch 4: the reference every layout matches."""
    return run(data_dir, tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def torchrun_run(request, data_dir, tmp_path_factory) -> tuple[str, Path, list[str]]:
    """2 nodes x 1 process, one torchrun per node (only --node-rank differs): (strategy, run folder, outputs)."""
    strategy = request.param
    out = tmp_path_factory.mktemp(f"torchrun_{strategy}")
    lantern, port = command(data_dir, out, *two_nodes(strategy)), free_port()
    logs = [out / f"node{node}.log" for node in (0, 1)]
    processes = [start(torchrun(node, port, lantern), logs[node], environment()) for node in (0, 1)]
    return strategy, out / "run", finish(processes, logs)


@pytest.mark.slow
def test_torchrun_on_two_nodes_matches_one_process(torchrun_run, single):
    _, run_dir, outputs = torchrun_run
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in outputs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
    assert_losses_match(run_dir, single, range(1, STEPS + 1), abs_=1e-5)
    assert_same_weights(final_weights(run_dir), final_weights(single), atol=1e-4)


def slurm_task(rank: int, nodes: int, per_node: int, port: int) -> dict[str, str]:
    """What ``srun`` sets for task ``rank`` of a job of ``nodes`` x ``per_node`` tasks (what Lightning's
    SLURMEnvironment reads); MASTER_ADDR comes from the node list, MASTER_PORT is exported, as docs/distributed.md
    says."""
    return {
        **environment(),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lantern-test", "SLURM_NODELIST": "127.0.0.1,127.0.0.1",
        "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node), "MASTER_PORT": str(port),
    }  # fmt: skip


@pytest.mark.slow
def test_slurm_two_nodes_of_two_tasks_match_one_process(data_dir, tmp_path, single):
    """srun's 4 tasks (2 nodes x --ntasks-per-node=2), FSDP2 sharded over both nodes: each task takes its rank
    from SLURM_PROCID (Lightning starts no process of its own) and the run is the one-process run."""
    lantern, port = command(data_dir, tmp_path, *two_nodes("fsdp", devices=2)), free_port()
    logs = [tmp_path / f"task{rank}.log" for rank in range(4)]
    processes = [start(lantern, logs[rank], slurm_task(rank, 2, 2, port)) for rank in range(4)]
    outputs = finish(processes, logs)
    for rank, output in enumerate(outputs):
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/4" in output, output[-3000:]
    assert_losses_match(tmp_path / "run", single, range(1, STEPS + 1), abs_=1e-5)
    assert_same_weights(final_weights(tmp_path / "run"), final_weights(single), atol=1e-4)


@pytest.mark.slow
def test_resume_on_another_node_count(torchrun_run, data_dir, tmp_path):
    """The 2 x 1 run's step-4 checkpoint resumed on 1 node x 2 processes and on 1 x 1 (same global batch) ends
    as the uninterrupted 2 x 1 run: bit for bit on the same world size, to fp32 rounding on one process. An FSDP2
    sharded folder reshards onto one process under trainer.strategy=fsdp."""
    strategy, uninterrupted, _ = torchrun_run
    checkpoint = uninterrupted / "checkpoints" / "step-00000004.ckpt"
    resumed = range(5, STEPS + 1)
    one_node = run(
        data_dir, tmp_path / "1x2", f"trainer.strategy={strategy}", "trainer.devices=2", per_rank(2),
        f"checkpoint.resume={checkpoint}",
    )  # fmt: skip
    assert_losses_match(one_node, uninterrupted, resumed, abs_=0)
    assert_same_weights(final_weights(one_node), final_weights(uninterrupted), atol=0)
    one_process = "trainer.strategy=single" if strategy == "ddp" else "trainer.strategy=fsdp"
    alone = run(data_dir, tmp_path / "1x1", one_process, per_rank(1), f"checkpoint.resume={checkpoint}")
    assert_losses_match(alone, uninterrupted, resumed, abs_=1e-5)
    assert_same_weights(final_weights(alone), final_weights(uninterrupted), atol=1e-4)


def test_the_strategies_take_the_collective_timeout():
    """trainer.collective_timeout_s is the process group's timeout under DDP and FSDP2 (half an hour unless set,
    Lightning's and torch's own default), and must be positive."""
    from models.config_checks import check_config
    from trainer.build import make_strategy
    from trainer.config import ConfigError, TrainerConfig

    for strategy in ("ddp", "fsdp"):
        made = make_strategy(TrainerConfig(strategy=strategy, devices=2, collective_timeout_s=42))
        assert made._timeout.total_seconds() == 42
    assert make_strategy(TrainerConfig(strategy="ddp"))._timeout.total_seconds() == 1800
    with pytest.raises(ConfigError, match="trainer.collective_timeout_s must be > 0"):
        check_config(TrainerConfig(strategy="ddp", collective_timeout_s=0), prefix="trainer.")


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, strategy, how",
    [("torchrun", "ddp", signal.SIGKILL), ("lightning", "ddp", signal.SIGSTOP), ("torchrun", "fsdp", signal.SIGSTOP)],
    ids=["torchrun-ddp-node-killed", "lightning-ddp-node-hung", "torchrun-fsdp-node-hung"],
)
def test_the_other_node_exits_non_zero_in_bounded_time_when_one_dies(data_dir, tmp_path, launcher, strategy, how):
    """Node 1 is killed (kill -9 of all its processes: its sockets close, node 0's next collective fails at once)
    or hangs (SIGSTOP: its sockets stay open and silent, as when a machine freezes or drops off the network) after
    the first checkpoint. Node 0 exits non-zero, after trainer.collective_timeout_s at most (plus the time to
    stop), saying in one line why; a verified checkpoint is there to resume from."""
    lantern = command(
        data_dir, tmp_path, *two_nodes(strategy), "trainer.max_steps=1000",
        f"trainer.collective_timeout_s={HANG_TIMEOUT_S}",
    )  # fmt: skip
    port, logs = free_port(), [tmp_path / f"node{node}.log" for node in (0, 1)]
    processes = []
    for node in (0, 1):
        if launcher == "torchrun":
            argv, env = torchrun(node, port, lantern), environment()
        else:  # Lightning's launcher, one process per node
            argv = lantern
            env = {**environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node)}
        processes.append(start(argv, logs[node], env))
    victim: list[int] = []
    try:
        wait_for_checkpoint(processes[0], tmp_path / "run" / "checkpoints", 4)
        victim = process_tree(processes[1].pid)
        signal_all(victim, how)  # the whole node: torchrun's agent and its worker alike
        stopped = time.monotonic()
        code = processes[0].wait(timeout=HANG_TIMEOUT_S + 90)
        waited = time.monotonic() - stopped
    finally:
        signal_all(victim, signal.SIGKILL)
        kill_running(processes)
    output = logs[0].read_text(errors="replace")
    assert code != 0, output[-3000:]
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") is not None  # the same command resumes from it
    if how == signal.SIGKILL:
        assert "rank 0 stops: another rank died" in output, output[-3000:]
        assert waited < 60, waited  # a closed connection fails the next collective at once
    else:
        assert "rank 0 stops: another rank stopped responding" in output, output[-3000:]
        # gloo used our timeout: it says so in a collective, and words it otherwise when it strikes in a barrier
        assert f"Timed out waiting {HANG_TIMEOUT_S * 1000}ms" in output or "Application timeout" in output, output[
            -3000:
        ]
        # not before the timeout (node 0 may have begun waiting just before node 1 stopped), nor long after it
        assert HANG_TIMEOUT_S / 2 <= waited < HANG_TIMEOUT_S + 45, waited
