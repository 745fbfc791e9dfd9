"""RL's scoring passes on a real chat model, the prompts' shared prefix run once against every row scored whole: the
seconds of one GRPO rollout's reference log-probs (adapters off, no gradient) and policy forward + backward (LoRA),
in the preset's micro-batches, on rows the model sampled itself.

    lantern convert --from gguf ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --to native runs/smollm2-135m-instruct
    python -m benchmarks.bench_rl_scoring runs/smollm2-135m-instruct [--repeats 5]

The rollout is configs/pipeline/smollm2.yaml's: 4 arithmetic questions x 8 samples at temperature 1, at most 32 new
tokens, SmolLM2's chat template (its system turn and user header are what every prompt shares), LoRA rank 16 on every
linear layer, micro-batches of 16. Both ways run interleaved, ``--repeats`` times, in one process; the median is
kept, and the largest log-prob difference between them shows they score the same thing. Writes
``benchmarks/results/rl_scoring.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from alignment.shared.responses import response_logprobs
from data.demo.arithmetic import write_arithmetic_dataset
from data.records.prompts import PromptDataConfig, load_prompts
from data.tokenizer.tokenizer import Tokenizer
from models.adapters import adapters_disabled, add_adapters
from models.files.atomic import write_atomically
from models.formats.checkpoint import load_checkpoint
from models.generation import generate, left_pad
from models.model_config import PeftConfig
from models.prefill import shared_prefix_length

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS, GROUP, NEW_TOKENS, MICRO_BATCH = 4, 8, 32, 16


def rollout(model, tokenizer: Tokenizer, checkpoint: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A GRPO rollout's rows as the stage builds them: (input_ids, real, prompt length, shared prefix)."""
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_arithmetic_dataset(scratch, tasks=["add", "multiply"], n_train=2, n_val=QUESTIONS, n_pairs=2)
        config = PromptDataConfig(tokenizer=checkpoint, max_prompt_tokens=96)
        prompts = [p["prompt_ids"] for p in load_prompts(config, [str(paths["prompts"])], tokenizer)[0]]
    group = [p for p in prompts for _ in range(GROUP)]
    with torch.no_grad():
        out = generate(
            model, group, max_new_tokens=NEW_TOKENS, temperature=1.0, stop_ids=tokenizer.stop_ids,
            pad_id=tokenizer.pad_id, generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
    prompt_ids, prompt_real = left_pad(group, tokenizer.pad_id)
    input_ids = torch.cat([prompt_ids, out.tokens], 1)
    return input_ids, torch.cat([prompt_real, out.mask], 1), prompt_ids.shape[1], shared_prefix_length(group)


def scoring_pass(model, input_ids, real, P: int, shared: int) -> tuple[float, torch.Tensor]:
    """Seconds of the reference and policy passes over every micro-batch, and the policy's log-probs."""
    start, logps = time.perf_counter(), []
    for rows in torch.arange(len(input_ids)).split(MICRO_BATCH):
        with adapters_disabled(model), torch.no_grad():
            response_logprobs(model, input_ids[rows], real[rows], P, 1.0, shared)
        logp, _ = response_logprobs(model, input_ids[rows], real[rows], P, 1.0, shared)
        (logp * real[rows, P:]).sum().backward()
        logps.append(logp.detach())
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, torch.cat(logps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a native model folder with a chat template (lantern convert writes one)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rl_scoring.json"))
    args = parser.parse_args()
    if not (Path(args.checkpoint) / "lantern.json").is_file():
        parser.error(f"{args.checkpoint}: not a native model folder (`lantern convert --to native` writes one)")
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.load(args.checkpoint)
    model = add_adapters(load_checkpoint(args.checkpoint), PeftConfig(kind="lora", rank=16, alpha=32.0))
    input_ids, real, P, shared = rollout(model, tokenizer, args.checkpoint, args.seed)
    mask = real[:, P:]
    seconds: dict[str, list[float]] = {"prefix once": [], "rows whole": []}
    logps = {}
    for _ in range(args.repeats):
        for name, prefix in (("prefix once", shared), ("rows whole", 0)):
            elapsed, logps[name] = scoring_pass(model, input_ids, real, P, prefix)
            seconds[name].append(elapsed)
    median = {name: statistics.median(times) for name, times in seconds.items()}
    difference = float((logps["prefix once"] - logps["rows whole"]).abs()[mask].max())
    results = {
        "checkpoint": args.checkpoint, "rows": list(input_ids.shape), "prompt_width": P, "shared_prefix": shared,
        "response_tokens_mean": float(mask.sum(1).float().mean()), "micro_batch": MICRO_BATCH,
        "seconds": seconds, "median_seconds": median, "speedup": median["rows whole"] / median["prefix once"],
        "max_logprob_difference": difference,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
    }  # fmt: skip
    print(f"rows {tuple(input_ids.shape)}, prompt width {P}, shared prefix {shared} tokens")
    for name, value in median.items():
        print(f"{name:12s} {value:6.2f} s a rollout (median of {args.repeats})")
    print(f"speedup {results['speedup']:.2f}x; largest log-prob difference {difference:.1e}")
    write_atomically(Path(args.out), json.dumps(results, indent=1) + "\n", what="RL scoring results")


if __name__ == "__main__":
    main()
