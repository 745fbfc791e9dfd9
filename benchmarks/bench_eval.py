"""
``lantern eval``'s lm-eval backend against lm-eval's own ``hf`` backend on SmolLM2-135M-Instruct (CPU, fp32), on the
same requests in one process: wall time of a log-likelihood task and a generation task, and how far their numbers
are apart.

    python -m benchmarks.bench_eval [--limit 100] [--batch-size 8] [--threads 2] [--work DIR]

Both sides start from the same fp32 weights: the GGUF converted to a native and to a Hugging Face folder
(``benchmarks.bench_real_model.checkpoints``, cached in --work). The requests are lm-eval's own, built by the demo
tasks (``data/demo/harness.py``): ``lantern_demo_choice`` (2 log-likelihood requests per prompt) and
``lantern_demo_answers`` (greedy, until a newline, at most 16 tokens), --limit documents each; ``--apply-chat-template``
is off, as in lm-eval's default. Each side answers every request once after a 2-request warm-up; --repeats runs
alternate the sides and the median is kept. Results: the table, and benchmarks/results/eval.json (--json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.bench_real_model import checkpoints

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks/results/eval.json"
TASKS = {"loglikelihood": "lantern_demo_choice", "generate_until": "lantern_demo_answers"}


def build(args: argparse.Namespace, work: Path):
    from lm_eval.models.huggingface import HFLM

    from data.demo.harness import write_harness_tasks
    from data.tokenizer.base import load_tokenizer
    from models.formats.checkpoint import load_checkpoint
    from trainer.harness import LanternLM
    from trainer.harness_tasks import task_manager

    native, hf = checkpoints(work)
    ours = LanternLM(load_checkpoint(native), load_tokenizer(native), batch_size=args.batch_size)
    theirs = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=args.batch_size)
    folder = write_harness_tasks(work / "harness", n=max(args.limit, 8))
    tasks = task_manager([folder], list(TASKS.values())).load(list(TASKS.values()))["tasks"]
    requests = {}
    for method, name in TASKS.items():
        tasks[name].build_all_requests(limit=args.limit, rank=0, world_size=1)
        requests[method] = list(tasks[name].instances)
    return ours, theirs, requests


def timed(lm, method: str, requests) -> tuple[float, list]:
    start = time.perf_counter()
    out = getattr(lm, method)(requests, disable_tqdm=True)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--limit", type=int, default=100, help="documents per task")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work", type=Path, default=None, help="converted checkpoints (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        ours, theirs, requests = build(args, work)
        rows = {}
        for method, reqs in requests.items():
            for lm in (ours, theirs):  # warm-up: first calls of each kernel
                getattr(lm, method)(reqs[:2], disable_tqdm=True)
            times = {"lantern": [], "hf": []}
            for _ in range(args.repeats):
                (t_ours, mine), (t_theirs, reference) = timed(ours, method, reqs), timed(theirs, method, reqs)
                times["lantern"].append(t_ours)
                times["hf"].append(t_theirs)
                print(f"{method}: lantern {t_ours:.1f} s, hf {t_theirs:.1f} s", flush=True)
            if method == "loglikelihood":
                gap = max(abs(a[0] - b[0]) for a, b in zip(mine, reference, strict=True))
                agreement = {
                    "max_abs_logprob_gap": gap,
                    "greedy_flags_equal": [g for _, g in mine] == [g for _, g in reference],
                }
            else:
                agreement = {"texts_equal": sum(a == b for a, b in zip(mine, reference, strict=True)) / len(mine)}
            seconds = {side: statistics.median(values) for side, values in times.items()}
            rows[method] = {"task": TASKS[method], "requests": len(reqs), "seconds": seconds,
                            "speedup": seconds["hf"] / seconds["lantern"], **agreement}  # fmt: skip

    print("\n| requests | task | n | lantern s | hf s | speed-up | agreement |\n|---|---|---|---|---|---|---|")
    for method, row in rows.items():
        agreement = {k: v for k, v in row.items() if k in ("max_abs_logprob_gap", "greedy_flags_equal", "texts_equal")}
        print(f"| {method} | {row['task']} | {row['requests']} | {row['seconds']['lantern']:.1f} | "
              f"{row['seconds']['hf']:.1f} | {row['speedup']:.2f}x | {agreement} |")  # fmt: skip
    result = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "batch_size": args.batch_size,
              "limit": args.limit, "torch": torch.__version__, "rows": rows}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
