"""The compiled static decode over a model wrapped as training wraps it (trainer.parallel: activation checkpointing,
torch.compile per block, FSDP2), on 2 gloo processes on this CPU (issue 22).

Before: ``torch._dynamo.exc.Unsupported: Attempted to inline function marked as skipped ... OptimizedModule.__call__``
at ``x = layer(...)`` in the decode step, for FSDP2-wrapped compiled blocks. Now the step runs the blocks under their
wrappers (``models.fast_decode.decode_blocks``) with the weights gathered once (``unsharded_for_generation``), and
its tokens are the plain model's. The PPO / GRPO runs under the same wrappers are in tests/alignment.

The ranks meet through a file store (no port to pick and lose to another process before rank 0 binds it) and run
under ``tests.helpers.spawn_ranks``: a rank that fails or dies is named with its signal and the end of its output.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models.generation import generate
from tests.helpers import spawn_ranks
from tests.models.test_generation import PROMPTS, tiny_model

WRAPPERS = {
    "fsdp": (False, False),
    "fsdp+compile": (True, False),
    "fsdp+compile+checkpointing": (True, True),
}


def decode_under_wrappers(rank: int, out_dir: str) -> None:
    """One rank: the plain model's eager tokens, then each wrapping's compiled-decode tokens (greedy and sampled)."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel import apply_activation_checkpointing, apply_compile, apply_fsdp, unsharded_for_generation

    # one thread and inductor compiling in-process come with spawn_ranks' environment (tests.helpers.subprocess_env)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def run(model, decode: str) -> dict[str, list]:
            greedy = generate(model, PROMPTS, max_new_tokens=10, temperature=0, decode=decode)
            sampled = generate(
                model, PROMPTS, max_new_tokens=10, temperature=1.0, decode=decode,
                generator=torch.Generator().manual_seed(rank),
            )  # fmt: skip
            return {"greedy": greedy.tokens.tolist(), "sampled": sampled.tokens.tolist()}

        results = {"plain": run(tiny_model(), "eager")}
        for name, (compiled, checkpointed) in WRAPPERS.items():
            model = tiny_model()
            if checkpointed:
                apply_activation_checkpointing(model, "full")
            if compiled:
                apply_compile(model)
            apply_fsdp(model, mesh, extra_forward_methods=("token_losses", "hidden_states"))
            with unsharded_for_generation(model):
                results[name] = run(model, "compiled")
        model = tiny_model()
        apply_fsdp(model, mesh, extra_forward_methods=("token_losses", "hidden_states"))
        with warnings.catch_warnings(record=True) as caught:  # still sharded: decodes eagerly, and says so
            warnings.simplefilter("always")
            results["sharded"] = run(model, "compiled")
        results["sharded warned"] = any("sharded" in str(w.message) for w in caught)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()  # neither rank leaves while the other may still be in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_decode_of_fsdp2_compiled_checkpointed_blocks_equals_eager(tmp_path):
    # cold, on 2 loaded cores, the ranks take about 4 minutes (82 s alone)
    spawn_ranks(decode_under_wrappers, (str(tmp_path),), world=2, log_dir=tmp_path, timeout=1200)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in WRAPPERS:
            assert results[name] == results["plain"], (rank, name)
        assert results["sharded"] == results["plain"] and results["sharded warned"], rank
