"""How much room a model leaves on the arithmetic tasks (data/demo/arithmetic.py): its greedy and sampled accuracy per
task on held-out questions, each ± SE, as the pipeline's report scores them (chat template, the checker, one token
budget). A task is kept for RL when the model gets between 5% and 60% of it right: some reward to start from, and
room above it.

    lantern convert --from gguf ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --to native runs/smollm2-135m-instruct
    python -m benchmarks.task_room runs/smollm2-135m-instruct

Writes ``benchmarks/results/task_room.json`` (``--out``) and prints a table. Greedy answers are deterministic on one
machine, thread count and torch build; the samples are seeded.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from alignment.shared.evaluation import heldout_summary, mean_score, sample_answers
from data.demo.arithmetic import OPERATIONS, write_arithmetic_dataset
from data.demo.scoring import score_example
from data.records.prompts import PromptDataConfig, load_prompts
from data.tokenizer.tokenizer import Tokenizer
from models.files.atomic import write_atomically
from models.formats.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
KEEP = (0.05, 0.60)  # the greedy accuracy a task is kept between


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a native model folder (lantern convert writes one from a GGUF file)")
    parser.add_argument("--tasks", default=",".join(OPERATIONS))
    parser.add_argument("--prompts", type=int, default=100, help="held-out questions per task")
    parser.add_argument("--samples", type=int, default=1, help="samples per question at temperature 1")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "task_room.json"))
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    tokenizer = Tokenizer.load(args.checkpoint)
    model = load_checkpoint(args.checkpoint).eval()
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_arithmetic_dataset(
            scratch, tasks=tasks, n_train=len(tasks), n_val=args.prompts * len(tasks), n_pairs=len(tasks)
        )
        config = PromptDataConfig(tokenizer=args.checkpoint, max_prompt_tokens=192)
        prompts = load_prompts(config, [str(paths["prompts"])], tokenizer)[0]
    ids = [p["prompt_ids"] for p in prompts]
    start = time.perf_counter()
    greedy = [
        a[0]
        for a in sample_answers(model, tokenizer, ids, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    ]
    generator = torch.Generator().manual_seed(args.seed)
    sampled = sample_answers(
        model, tokenizer, ids, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        samples=args.samples, temperature=1.0, generator=generator,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    greedy_scores = [score_example(p["record"], a) for p, a in zip(prompts, greedy)]
    sampled_scores = [mean_score([score_example(p["record"], a) for a in s]) for p, s in zip(prompts, sampled)]
    greedy_summary, sampled_summary = heldout_summary(prompts, greedy_scores), heldout_summary(prompts, sampled_scores)
    results = {
        "checkpoint": str(args.checkpoint), "prompts_per_task": args.prompts, "samples": args.samples,
        "max_new_tokens": args.max_new_tokens, "keep_between": KEEP, "seconds": round(seconds, 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "greedy": greedy_summary, "sampled": sampled_summary,
        "kept": [t for t in tasks if KEEP[0] <= greedy_summary["per_task"][t]["accuracy"] <= KEEP[1]],
        "examples": [{"prompt": p["record"]["messages"][0]["content"], "greedy": a, "score": s}
                     for p, a, s in list(zip(prompts, greedy, greedy_scores))[:: max(1, len(prompts) // 12)]],
    }  # fmt: skip
    print(f"{'task':10s} {'greedy ± SE':>16s} {'sampled ± SE':>16s}")
    for task in tasks:
        g, s = greedy_summary["per_task"][task], sampled_summary["per_task"][task]
        print(f"{task:10s} {g['accuracy']:8.3f} ± {g['se']:.3f} {s['accuracy']:8.3f} ± {s['se']:.3f}")
    print(f"kept (greedy accuracy in [{KEEP[0]}, {KEEP[1]}]): {results['kept']}; {seconds:.0f} s")
    write_atomically(Path(args.out), json.dumps(results, indent=1) + "\n", what="task room results")


if __name__ == "__main__":
    main()
