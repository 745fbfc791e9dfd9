"""FSDP2 (and DDP with Muon) against single-process runs, exact resume (graceful stop and kill -9), simulated multi-node.

Every run is a real ``lantern pretrain`` process (Lightning re-launches the command for extra ranks), on the
tiny preset, 2 gloo processes on this CPU.
"""

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import family_block, run_command, subprocess_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def command(data_dir: Path, out_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "alignment.commands.cli", "pretrain", str(ROOT / "configs/pretrain/tiny.yaml"),
        f"data.out_dir={data_dir}", f"run.out_dir={out_dir}", "run.name=run", "logger.kind=none",
        f"trainer.max_steps={STEPS}", "trainer.val_every_n_steps=100", "trainer.accelerator=cpu",
        "checkpoint.every_n_steps=4", "checkpoint.keep_last=5", *overrides,
    ]  # fmt: skip


def environment() -> dict[str, str]:
    return subprocess_env(WANDB_MODE="offline")


def run(data_dir: Path, out_dir: Path, *overrides: str, env: dict | None = None) -> Path:
    result = run_command(command(data_dir, out_dir, *overrides), env=env or environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out_dir / "run"


def train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as handle:
        return {
            int(row["step"]): float(row["value"]) for row in csv.DictReader(handle) if row["metric"] == "train/loss"
        }


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a run's final/ under Lantern's own names."""
    return model_weights(run_dir / "final")


def model_weights(folder: Path) -> dict[str, torch.Tensor]:
    from models.formats.checkpoint import load_checkpoint

    return dict(load_checkpoint(folder).state_dict())


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


FSDP = ("trainer.strategy=fsdp", "trainer.devices=2", "loader.micro_batch_size=2")  # global batch 4 = single's


@pytest.fixture(scope="module")
def single_fp32(data_dir, tmp_path_factory) -> Path:
    return run(data_dir, tmp_path_factory.mktemp("single_fp32"))


@pytest.fixture(scope="module")
def fsdp_fp32(data_dir, tmp_path_factory) -> Path:
    return run(data_dir, tmp_path_factory.mktemp("fsdp_fp32"), *FSDP)


def test_fsdp_fp32_matches_single_process(single_fp32, fsdp_fp32):
    """Same global batch, same init: FSDP2 over 2 ranks computes the same training run (fp32: to 1e-4)."""
    single, sharded = train_losses(single_fp32), train_losses(fsdp_fp32)
    assert sorted(single) == sorted(sharded) == list(range(1, STEPS + 1))  # loss of the batch that made step N
    for step in single:
        assert sharded[step] == pytest.approx(single[step], abs=1e-4), step
    assert_same_weights(final_weights(single_fp32), final_weights(fsdp_fp32), atol=1e-4)


def test_fsdp_bf16_activation_checkpointing_matches_single_process(data_dir, tmp_path):
    """bf16 compute (FSDP2 MixedPrecisionPolicy vs autocast) rounds differently: losses agree to 2e-2."""
    single = run(data_dir, tmp_path / "single", "trainer.precision=bf16-mixed")
    sharded = run(
        data_dir, tmp_path / "fsdp", *FSDP, "trainer.precision=bf16-mixed", "trainer.activation_checkpointing=full"
    )
    single_losses, sharded_losses = train_losses(single), train_losses(sharded)
    for step in single_losses:
        assert sharded_losses[step] == pytest.approx(single_losses[step], abs=2e-2), step
    assert sharded_losses[STEPS] < sharded_losses[1] - 0.1  # and it trains


DDP = ("trainer.strategy=ddp", "trainer.devices=2", "loader.micro_batch_size=2")  # global batch 4 = single's


def test_ddp_muon_matches_single_process_muon(data_dir, tmp_path):
    """optim.name=muon: DDP averages the gradients before the step and every rank orthogonalises the whole matrices,
    so 2 ranks compute the single process's run: losses to 1e-4. Weights to 5e-3 relative, not AdamW's 1e-5: torch's
    Muon runs Newton-Schulz in bf16, where the all-reduce's last-bit differences now and then round to another bf16
    value (with the iteration in fp32 the same 8 steps agree to 2e-6; measured in-process). (FSDP2 shards the
    matrices: refused at load.)"""
    single = run(data_dir, tmp_path / "single", "optim.name=muon")
    ddp = run(data_dir, tmp_path / "ddp", *DDP, "optim.name=muon")
    single_losses, ddp_losses = train_losses(single), train_losses(ddp)
    assert sorted(single_losses) == sorted(ddp_losses) == list(range(1, STEPS + 1))
    for step in single_losses:
        assert ddp_losses[step] == pytest.approx(single_losses[step], abs=1e-4), step
    assert single_losses[STEPS] < single_losses[1] - 0.1  # and it trains
    ours, theirs = final_weights(single), final_weights(ddp)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert (ours[name] - theirs[name]).norm() <= 5e-3 * ours[name].norm(), name


def wait_for_checkpoint(process: subprocess.Popen, checkpoint_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    name = f"step-{step:08d}.ckpt"
    while time.time() < deadline:
        latest = checkpoint_dir / "latest"
        if latest.is_file() and latest.read_text().strip() >= name:
            return
        if process.poll() is not None:
            raise AssertionError(f"training exited ({process.returncode}) before checkpoint {name}")
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint {name} after {timeout}s")


def interrupt_and_resume(data_dir: Path, out_dir: Path, how: signal.Signals, *overrides: str) -> Path:
    process = subprocess.Popen(
        command(data_dir, out_dir, *overrides),
        cwd=ROOT,
        env=environment(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_checkpoint(process, out_dir / "run" / "checkpoints", 4)
        os.killpg(process.pid, how)  # the whole group: Lightning's launcher started the other ranks
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert not (out_dir / "run" / "final").exists(), "the run finished before it was interrupted"
    return run(data_dir, out_dir, *overrides)  # checkpoint.resume=auto picks up the latest checkpoint


def test_single_process_resume_after_sigterm_is_exact(data_dir, tmp_path, single_fp32):
    """(kill -9 at every phase of training and checkpoint writing, single process and FSDP2: tests/faults/test_kill.py)"""
    resumed = interrupt_and_resume(data_dir, tmp_path, signal.SIGTERM, f"trainer.max_steps={STEPS}")
    uninterrupted = train_losses(single_fp32)
    losses = train_losses(resumed)
    assert set(range(5, STEPS + 1)) <= set(losses)  # the resumed part (and earlier steps, when they were saved)
    for step, loss in losses.items():
        assert loss == pytest.approx(uninterrupted[step], abs=1e-6), step
    assert_same_weights(final_weights(resumed), final_weights(single_fp32), atol=1e-6)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_on_loopback_match_fsdp_on_one_node(data_dir, tmp_path, fsdp_fp32):
    """2 nodes x 1 device, launched as a cluster scheduler would (one command per node, NODE_RANK set)."""
    port = str(free_port())
    overrides = ("trainer.strategy=fsdp", "trainer.devices=1", "trainer.num_nodes=2", "loader.micro_batch_size=2")
    processes = []
    for node_rank in (0, 1):
        env = {**environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node_rank)}
        processes.append(
            subprocess.Popen(
                command(data_dir, tmp_path, *overrides),
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-5000:]
    assert "GLOBAL_RANK: 1" in "".join(outputs)
    multi_node = train_losses(tmp_path / "run")
    for step, loss in train_losses(fsdp_fp32).items():
        assert multi_node[step] == pytest.approx(loss, abs=1e-5), step


def test_export_consolidates_fsdp_shards(fsdp_fp32, tmp_path):
    """The sharded training checkpoint of the last step, consolidated without a process group, equals the
    final model the run exported itself."""
    from trainer.export import export_training_checkpoint

    shards = fsdp_fp32 / "checkpoints" / f"step-{STEPS:08d}.ckpt"
    assert shards.is_dir() and len(list(shards.glob("*.distcp"))) == 2
    out = export_training_checkpoint(shards, tmp_path / "exported")
    assert_same_weights(model_weights(out), final_weights(fsdp_fp32), atol=0)
    assert (out / "tokenizer.model").is_file()


# Gemma 3's block on the tiny preset: its local layers (a 16-token window, shorter than the rows) take their own RoPE
# tables and mask as block inputs, through FSDP2's hooks and activation checkpointing's wrapper
GEMMA3 = (
    *(f"model.{key}={value}" for key, value in family_block("Gemma3ForCausalLM").items()),
    "model.attention_scale_dim=32", "model.sliding_window=16", "model.sliding_window_pattern=2",
    "model.rope_local_theta=10000",
)  # fmt: skip


def test_gemma3_blocks_under_fsdp_and_activation_checkpointing_match_single_process(data_dir, tmp_path):
    """fp32: FSDP2 over 2 ranks with every block checkpointed computes the single process's run to 1e-4."""
    single = run(data_dir, tmp_path / "single", *GEMMA3)
    sharded = run(data_dir, tmp_path / "fsdp", *GEMMA3, *FSDP, "trainer.activation_checkpointing=full")
    single_losses, sharded_losses = train_losses(single), train_losses(sharded)
    assert sorted(single_losses) == sorted(sharded_losses) == list(range(1, STEPS + 1))
    for step in single_losses:
        assert sharded_losses[step] == pytest.approx(single_losses[step], abs=1e-4), step
    assert_same_weights(final_weights(single), final_weights(sharded), atol=1e-4)
    assert "layers.0.post_ffn_norm.weight" in final_weights(single)  # it was Gemma's block that trained
