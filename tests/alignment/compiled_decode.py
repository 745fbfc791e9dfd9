"""A real ``lantern`` run whose generation decodes compiled on this CPU, each call checked against eager decoding,
for the compiled-rollout tests of tests/alignment/test_ppo.py and test_grpo.py.

``python -m tests.alignment.compiled_decode ARGS`` is ``lantern ARGS`` (alignment.commands.cli.main) with
``decode="auto"`` resolving to the compiled static decode on the CPU too (as it does on CUDA: ``AUTO_DECODE``), and
every ``models.generation.generate`` call that decodes that way run a second time eagerly from the same generator
state. Each process appends one JSON line per call to ``LANTERN_TEST_DECODE_LOG``: the rank, the temperature, how
many compiled steps ran, and whether the tokens and masks equal the eager ones (and the log-probs' largest
difference). Lightning re-launches ``python -m tests.alignment.compiled_decode ARGS`` for the other ranks, so every
rank decodes and checks the same way.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from models import fast_decode, generation
from models.sampling import GenerationOutput
from tests.helpers import run_lantern, subprocess_env

DECODE_LOG = "LANTERN_TEST_DECODE_LOG"
LANTERN_PACKAGES = ("alignment.", "trainer.", "data.", "models.")

_compiled_steps = 0
_plain_compiled = fast_decode.compiled
_plain_generate = generation.generate


def _counting_compiled(step):
    compiled_step = _plain_compiled(step)

    def run(*args: Any, **kwargs: Any):
        global _compiled_steps
        _compiled_steps += 1
        return compiled_step(*args, **kwargs)

    return run


def checked_generate(model, prompts, **kwargs: Any) -> GenerationOutput:
    """``generate``, and when it decoded compiled, the eager decode of the same call compared with it."""
    global _compiled_steps
    generator = kwargs.get("generator")
    start = generator.get_state() if generator is not None else None
    _compiled_steps = 0
    out = _plain_generate(model, prompts, **kwargs)
    steps = _compiled_steps
    if steps:
        end = generator.get_state() if generator is not None else None
        if generator is not None:
            generator.set_state(start)
        eager = _plain_generate(model, prompts, **{**kwargs, "decode": "eager", "compile": False})
        if generator is not None:
            generator.set_state(end)  # the run goes on from where the compiled decode left the generator
        record = {
            "rank": int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))),
            "temperature": kwargs.get("temperature", 1.0),
            "compiled_steps": steps,
            "rows": len(out.tokens),
            "tokens_equal": torch.equal(out.tokens, eager.tokens),
            "mask_equal": torch.equal(out.mask, eager.mask),
            "max_logprob_difference": float((out.logprobs - eager.logprobs).abs().max())
            if out.logprobs.shape == eager.logprobs.shape
            else float("inf"),
        }
        with open(os.environ[DECODE_LOG], "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")
    return out


def run_checked(stage: str, *args: str, log: Path) -> list[dict[str, Any]]:
    """``lantern STAGE ARGS`` through this module in a new process (it must succeed); the records it logged."""
    env = subprocess_env(**{DECODE_LOG: str(log)})
    result = run_lantern(stage, *args, module="tests.alignment.compiled_decode", env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def main() -> None:
    generation.AUTO_DECODE["cpu"] = "compiled"
    fast_decode.compiled = _counting_compiled
    # the stages bind ``generate`` by name: those imported already (a warm CLI's child, tests/warm_cli.py) are
    # rebound, the others bind the checked one when imported
    generation.generate = checked_generate
    for name, module in list(sys.modules.items()):
        if name.startswith(LANTERN_PACKAGES) and getattr(module, "generate", None) is _plain_generate:
            module.generate = checked_generate
    from alignment.commands.cli import main as lantern

    lantern()


if __name__ == "__main__":
    main()
