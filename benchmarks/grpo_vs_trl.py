"""GRPO on a real model, Lantern against TRL's GRPOTrainer doing the same work: seconds per step (sampling and the
rest separately), peak memory, and the held-out accuracy after, scored by one evaluator.

    lantern convert --from gguf ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --to native runs/smollm2-135m-instruct
    lantern convert --from native runs/smollm2-135m-instruct --to hf runs/smollm2-135m-instruct-hf
    python -m benchmarks.grpo_vs_trl --native runs/smollm2-135m-instruct --hf runs/smollm2-135m-instruct-hf

The same work on both: the same weights (Lantern reads the native folder, TRL the Hugging Face export of it), the
arithmetic training questions of configs/pipeline/smollm2.yaml (each tool in its own order), the checker as the only reward,
configs/grpo/smollm2.yaml's group size, prompts per step, completion length, temperature, KL coefficient (k3),
clip range, token-level loss, LoRA rank, alpha and targets, learning rate (constant) and seed; one optimizer step per
rollout; CPU, no vLLM. Each runs in a process of its own (``--run``), which reports its peak RSS. Both final models are
then scored by Lantern's evaluator (greedy, the chat template, the same held-out questions), each paired with the
start model over the same questions. TRL is imported only here; nothing is installed.

Per-step times skip the first step (warm-up). Lantern's split is its own log (``grpo/generation_time``); TRL's is
``transformers.generate`` timed around its calls. Timings are wall clock on the machine named in the JSON; compare
the two in one run.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lora.memory import peak_rss

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "grpo" / "smollm2.yaml"


def grpo_config(args: argparse.Namespace, data: Path, out: Path) -> Any:
    from alignment.schemas.rl import GRPOConfig
    from trainer.config import load_config

    return load_config(
        GRPOConfig, PRESET,
        [
            f"init.policy={args.native}", f"data.train=[{data / 'train_prompts.jsonl'}]",
            f"data.val=[{data / 'prompts.jsonl'}]", f"run.out_dir={out}", "run.name=lantern",
            f"trainer.max_steps={args.steps}", f"run.seed={args.seed}", "eval.generations=1",
            f"eval.every_n_rollouts={10**6}", f"checkpoint.every_n_steps={10**6}", "logger.kind=csv",
        ],
    )  # fmt: skip


def run_lantern(args: argparse.Namespace, data: Path, out: Path) -> dict[str, Any]:
    from alignment.stages.registry import stage_named

    run_dir = stage_named("grpo").run(grpo_config(args, data, out))
    with open(run_dir / "csv" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    steps = [r for r in rows if r.get("grpo/step_time")][1:]  # the first is warm-up
    step = [float(r["grpo/step_time"]) for r in steps]
    generation = [float(r["grpo/generation_time"]) for r in steps]
    return {"final": str(run_dir / "final"), "step_s": step, "generation_s": generation,
            "score": [float(r["grpo/raw_score"]) for r in steps]}  # fmt: skip


def run_trl(args: argparse.Namespace, data: Path, out: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from data.demo.scoring import score_example
    from data.demo.tasks import load_jsonl

    preset = grpo_config(args, data, out)
    grpo, peft = preset.grpo, preset.peft
    rows = [{"prompt": r["messages"], "task": r["task"], "meta": json.dumps(r["meta"])}
            for r in load_jsonl(data / "train_prompts.jsonl")]  # fmt: skip

    def checker(completions: list, task: list, meta: list, **kwargs: Any) -> list[float]:
        return [
            score_example({"task": t, "meta": json.loads(m)}, c[0]["content"])
            for c, t, m in zip(completions, task, meta)
        ]

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.hf, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.hf)
    sequences = grpo.prompts_per_rollout * grpo.group_size
    config = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1,
        seed=args.seed, data_seed=args.seed, max_steps=args.steps, learning_rate=preset.optim.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=preset.optim.grad_clip,
        adam_beta1=preset.optim.betas[0], adam_beta2=preset.optim.betas[1],
        per_device_train_batch_size=sequences, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=grpo.group_size, max_completion_length=grpo.response_max_tokens,
        temperature=grpo.temperature, top_p=1.0, beta=grpo.kl_coef, epsilon=grpo.clip_ratio, loss_type="dapo",
        scale_rewards="group", num_iterations=grpo.epochs, use_vllm=False, shuffle_dataset=False,
    )  # fmt: skip
    lora = LoraConfig(r=peft.rank, lora_alpha=peft.alpha, lora_dropout=peft.dropout, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[checker], args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, peft_config=lora)  # fmt: skip
    generation: list[float] = []
    generate = trainer.model.generate

    def timed_generate(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generation.append(time.perf_counter() - start)

    trainer.model.generate = timed_generate
    step: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step.append(time.perf_counter() - self.start)

    trainer.add_callback(StepTimes())
    trainer.train()
    final = out / "trl" / "final"
    trainer.model.merge_and_unload().save_pretrained(final)
    tokenizer.save_pretrained(final)
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    return {"final": str(final), "step_s": step[1:], "generation_s": generation[1:], "score": rewards[1:]}


def heldout(checkpoint: str, data: Path, tokenizer_spec: str, limit: int) -> tuple[dict[str, Any], list[float]]:
    """Greedy answers to the held-out questions through Lantern's evaluator: (summary, per-question scores)."""
    from alignment.shared.evaluation import heldout_summary, sample_answers
    from data.demo.scoring import score_example
    from data.records.prompts import PromptDataConfig, load_prompts
    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.checkpoint import load_checkpoint

    tokenizer = Tokenizer.load(tokenizer_spec)
    config = PromptDataConfig(tokenizer=tokenizer_spec, max_prompt_tokens=96)
    prompts = load_prompts(config, [str(data / "prompts.jsonl")], tokenizer)[0][:limit]
    model = load_checkpoint(checkpoint).eval()
    answers = sample_answers(model, tokenizer, [p["prompt_ids"] for p in prompts], max_new_tokens=32, batch_size=50)
    scores = [score_example(p["record"], a[0]) for p, a in zip(prompts, answers)]
    return heldout_summary(prompts, scores), scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--native", default="runs/smollm2-135m-instruct")
    parser.add_argument("--hf", default="runs/smollm2-135m-instruct-hf")
    parser.add_argument("--steps", type=int, default=10, help="rollouts = optimizer steps, each contender")
    parser.add_argument("--heldout", type=int, default=600, help="held-out questions scored after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default="runs/grpo-vs-trl")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpo_vs_trl.json"))
    parser.add_argument("--run", choices=["lantern", "trl"], help=argparse.SUPPRESS)  # one contender, in this process
    args = parser.parse_args()
    work = Path(args.work)
    data = work / "data"
    if args.run:
        start = time.perf_counter()
        result = (run_lantern if args.run == "lantern" else run_trl)(args, data, work / args.run)
        result.update(wall_s=time.perf_counter() - start, peak_rss_gb=peak_rss() / 2**30)
        (work / f"{args.run}.json").write_text(json.dumps(result))
        return
    from alignment.shared.evaluation import paired_difference, verdict
    from data.demo.arithmetic import write_arithmetic_dataset

    write_arithmetic_dataset(data, tasks=["add", "multiply"], n_train=800, n_val=600, n_pairs=60, seed=0)
    results: dict[str, Any] = {
        "steps": args.steps,
        "machine": f"{platform.machine()}, {platform.node()}",
        "contenders": {},
    }
    for name in ("lantern", "trl"):
        command = [sys.executable, "-m", "benchmarks.grpo_vs_trl", "--run", name, *sys.argv[1:]]
        subprocess.run(command, cwd=ROOT, check=True)
        results["contenders"][name] = json.loads((work / f"{name}.json").read_text())
    start_summary, start_scores = heldout(args.native, data, args.native, args.heldout)
    results["start"] = start_summary
    for result in results["contenders"].values():
        summary, scores = heldout(result["final"], data, args.native, args.heldout)
        difference, se, n = paired_difference(scores, start_scores)
        result.update(
            heldout=summary, vs_start={"difference": difference, "se": se, "n": n, "verdict": verdict(difference, se)}
        )
        result.update(
            mean_step_s=statistics.mean(result["step_s"]), mean_generation_s=statistics.mean(result["generation_s"])
        )
    lantern, trl = results["contenders"]["lantern"], results["contenders"]["trl"]
    results["speedup_per_step"] = trl["mean_step_s"] / lantern["mean_step_s"]
    print(f"{'':10s} {'s/step':>8s} {'sampling s':>11s} {'peak GB':>8s} {'held-out ± SE':>16s} {'vs start ± SE':>16s}")
    print(f"{'start':10s} {'':8s} {'':11s} {'':8s} {start_summary['accuracy']:8.3f} ± {start_summary['se']:.3f}")
    for name, r in results["contenders"].items():
        h, v = r["heldout"], r["vs_start"]
        print(f"{name:10s} {r['mean_step_s']:8.1f} {r['mean_generation_s']:11.1f} {r['peak_rss_gb']:8.2f} "
              f"{h['accuracy']:8.3f} ± {h['se']:.3f} {v['difference']:+8.3f} ± {v['se']:.3f} ({v['verdict']})")  # fmt: skip
    print(f"Lantern per step: {results['speedup_per_step']:.2f}x TRL's")
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
