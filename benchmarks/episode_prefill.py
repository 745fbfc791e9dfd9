"""Multi-turn episodes: each turn prefilling only its new tokens from the last turn's keys and values
(``models.prefix_cache``, what ``generate_sampler`` does) against prefilling every turn's prompts whole, on a model
that calls the calculator (the tool-SFT or GRPO model of ``configs/pipeline/smollm2-tools.yaml``): the same greedy
episodes, the time they take and the prompt tokens prefilled. Arms alternate, ``--repeats`` times each; medians.

    python -m benchmarks.episode_prefill runs/pipeline-smollm2-tools/grpo/final [--episodes 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from alignment.shared.episodes import Environment, episode_stats, generate_sampler, run_episodes
from alignment.shared.tools import CALCULATOR
from data.demo.arithmetic import write_arithmetic_dataset
from data.demo.tasks import load_jsonl
from data.tokenizer.base import load_tokenizer
from models.formats.checkpoint import load_checkpoint
from models.generation import generate

LIMITS = {"max_turns": 3, "turn_tokens": 48, "episode_tokens": 512}  # the preset's report.episodes


def whole_prefill_sampler(model, tokenizer, counted: list[int]):
    """``generate_sampler`` without the kept prefixes: every turn's prompts prefilled whole (counted)."""

    def sample(rows, max_new_tokens):
        counted.append(sum(len(row) for row in rows))
        out = generate(
            model, rows, max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=tokenizer.stop_ids,
            pad_id=tokenizer.pad_id,
        )  # fmt: skip
        return [tokens[mask].tolist() for tokens, mask in zip(out.tokens, out.mask)]

    return sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a model folder that calls the calculator")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_checkpoint(args.model).eval(), load_tokenizer(args.model)
    with tempfile.TemporaryDirectory() as folder:
        files = write_arithmetic_dataset(
            folder, tasks=["multiply"], n_train=16, n_val=args.episodes, n_pairs=4, calculator=CALCULATOR.schema()
        )
        prompts = [{"messages": row["messages"]} for row in load_jsonl(files["prompts"])][: args.episodes]

    def play(kept: bool) -> tuple[float, list, int]:
        counted: list[int] = []
        episodes, started = [], time.perf_counter()
        with torch.no_grad():
            for start in range(0, len(prompts), args.batch_size):
                if kept:
                    sample = generate_sampler(model, tokenizer, temperature=0.0)
                else:
                    sample = whole_prefill_sampler(model, tokenizer, counted)
                batch = prompts[start : start + args.batch_size]
                episodes += run_episodes(Environment(), tokenizer, batch, sample, **LIMITS)
                if kept:
                    counted.append(sample.prefix_cache.prefilled_tokens)
        return time.perf_counter() - started, episodes, sum(counted)

    times: dict[str, list[float]] = {"kept prefixes": [], "whole prefill": []}
    results = {}
    for _ in range(args.repeats):
        for name in times:
            seconds, episodes, prefilled = play(name == "kept prefixes")
            times[name].append(seconds)
            results[name] = {"episodes": episodes, "prefilled_tokens": prefilled}
    same = [e.ids for e in results["kept prefixes"]["episodes"]] == [
        e.ids for e in results["whole prefill"]["episodes"]
    ]
    stats = episode_stats(results["kept prefixes"]["episodes"])
    report = {
        "model": str(args.model), "episodes": len(prompts), "threads": torch.get_num_threads(),
        "turns_per_episode": stats["turns"], "tool_calls_per_episode": stats["tool_calls"], "same_episodes": same,
        **{
            name: {"seconds": statistics.median(values), "runs": values,
                   "prefilled_tokens": results[name]["prefilled_tokens"]}
            for name, values in times.items()
        },
    }  # fmt: skip
    report["speedup"] = report["whole prefill"]["seconds"] / report["kept prefixes"]["seconds"]
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
