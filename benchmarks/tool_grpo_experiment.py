"""Issue 51's proof: does GRPO teach SmolLM2-135M-Instruct to use a calculator on held-out multiplication?

Every arm is scored greedily on the same held-out questions (2-digit times 1-digit, never trained on), paired:

    base          the instruct model, single turn, no tool
    base+tool     the instruct model with the calculator offered (an episode: it may call it)
    tool-SFT      a short LoRA SFT on demonstrations that call the calculator, scored with the tool
    GRPO          GRPO (LoRA) from the instruct model, single turn, no tool
    GRPO+tool     GRPO (LoRA) from tool-SFT over episodes with the calculator, scored with the tool

It prints accuracy ± SE, tool calls per episode, and the paired differences the issue asks for (GRPO+tool against
GRPO and against tool-SFT, each a gain only beyond 2 SE), and writes them to OUT/results.json. The stages run as
``lantern`` commands in child processes; the model is converted once into OUT (or given with --model).

    python -m benchmarks.tool_grpo_experiment --out runs/bench/tool-grpo [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKER = "data.demo.scoring:score_example"
ENVIRONMENT = "alignment.shared.episodes:Environment"  # the calculator on the question's own messages


def lantern(*args: str, final: Path | None = None) -> None:
    """``lantern ARGS`` in a child process (each stage in a fresh interpreter, as a user runs it), unless ``final``
    (its run's final model) is there from an earlier run of this script; fails loudly."""
    if final is not None and final.is_dir():
        print(f"  lantern {args[0]}: {final} is there, not run again", flush=True)
        return
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "alignment.commands.cli", *args], cwd=ROOT, check=True)
    print(f"  lantern {args[0]}: {time.perf_counter() - started:.0f} s", flush=True)


def score(model_dir: Path, prompts: list[dict[str, Any]], *, tool: bool, batch_size: int) -> dict[str, Any]:
    """Greedy answers of ``model_dir`` to ``prompts`` (episodes when ``tool``): the checker's score per prompt, and
    tool calls per episode."""
    import torch

    from alignment.shared.episodes import Environment, episode_stats, generate_sampler, run_episodes
    from alignment.shared.evaluation import sample_answers
    from data.demo.scoring import score_example
    from data.tokenizer.base import load_tokenizer
    from models.formats.checkpoint import load_checkpoint

    tokenizer, model = load_tokenizer(model_dir), load_checkpoint(model_dir).eval()
    stats: dict[str, float] = {}
    with torch.no_grad():
        if tool:
            episodes = []
            for start in range(0, len(prompts), batch_size):
                sample = generate_sampler(model, tokenizer, None, temperature=0.0)
                episodes += run_episodes(
                    Environment(), tokenizer, prompts[start : start + batch_size], sample, max_turns=3,
                    turn_tokens=48, episode_tokens=512,
                )  # fmt: skip
            answers, stats = [e.answer for e in episodes], episode_stats(episodes)
        else:
            ids = [tokenizer.encode_chat_prompt(p["messages"]) for p in prompts]
            answers = [a[0] for a in sample_answers(model, tokenizer, ids, max_new_tokens=48, batch_size=batch_size)]
    return {"scores": [score_example(p["record"], a) for p, a in zip(prompts, answers)], "answers": answers, **stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/tool-grpo"))
    parser.add_argument("--model", type=Path, help="a converted SmolLM2-135M-Instruct folder (default: convert)")
    parser.add_argument("--heldout", type=int, default=300, help="held-out questions every arm is scored on")
    parser.add_argument("--sft-steps", type=int, default=8, help="tool-SFT steps: 8 leaves it short of always calling")
    parser.add_argument("--grpo-steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few questions and steps")
    args = parser.parse_args()
    if args.quick:
        args.heldout, args.sft_steps, args.grpo_steps = 16, 2, 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    from alignment.shared.evaluation import mean_and_se, paired_difference, verdict
    from alignment.shared.tools import CALCULATOR
    from data.demo.arithmetic import write_arithmetic_dataset
    from data.demo.tasks import load_jsonl

    model = args.model.resolve() if args.model else out / "smollm2-135m-instruct"
    if not model.is_dir():
        lantern("convert", "--from", "gguf", str(GGUF), "--to", "native", str(model))
    data = write_arithmetic_dataset(
        str(out / "data"), tasks=["multiply"], n_train=400, n_val=max(args.heldout, 16), n_pairs=4,
        calculator=CALCULATOR.schema(),
    )  # fmt: skip
    heldout = [{"messages": r["messages"], "record": r} for r in load_jsonl(data["prompts"])][: args.heldout]
    common = [f"run.out_dir={out / 'runs'}", "logger.kind=csv", "checkpoint.every_n_steps=1000"]
    rl = [
        f"data.train=[{data['train_prompts']}]", f"data.val=[{data['prompts']}]", f"trainer.max_steps={args.grpo_steps}",
        "eval.generations=16", f"eval.every_n_rollouts={args.grpo_steps}", "data.max_prompt_tokens=96", *common,
    ]  # fmt: skip

    print("tool-SFT: LoRA on demonstrations that call the calculator", flush=True)
    lantern(
        "sft", "configs/sft/smollm2.yaml", f"init.checkpoint={model}", f"data.train=[{data['train']}]",
        f"data.val=[{data['val']}]", "data.seq_len=512", "loader.micro_batch_size=4", "run.name=tool-sft",
        f"trainer.max_steps={args.sft_steps}", f"trainer.val_every_n_steps={args.sft_steps}", "eval.generations=16",
        *common, final=out / "runs" / "tool-sft" / "final",
    )  # fmt: skip
    tool_sft = out / "runs" / "tool-sft" / "final"
    print("GRPO+tool: episodes with the calculator, from tool-SFT", flush=True)
    lantern(
        "grpo", "configs/grpo/smollm2.yaml", f"init.policy={tool_sft}", "run.name=grpo-tool",
        f"episodes.environment={ENVIRONMENT}", "episodes.max_turns=3", "episodes.max_tokens=512", *rl,
        "grpo.response_max_tokens=48",  # one turn: a calculator call is about 30 tokens
        final=out / "runs" / "grpo-tool" / "final",
    )  # fmt: skip
    print("GRPO: single turn, no tool, from the instruct model", flush=True)
    lantern(
        "grpo", "configs/grpo/smollm2.yaml", f"init.policy={model}", "run.name=grpo", *rl, "grpo.response_max_tokens=48",
        final=out / "runs" / "grpo" / "final",
    )  # fmt: skip

    arms = {
        "base": (model, False),
        "base+tool": (model, True),
        "tool-SFT": (tool_sft, True),
        "GRPO": (out / "runs" / "grpo" / "final", False),
        "GRPO+tool": (out / "runs" / "grpo-tool" / "final", True),
    }
    results: dict[str, Any] = {"heldout": len(heldout), "sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps}
    for name, (folder, tool) in arms.items():
        scored = score(folder, heldout, tool=tool, batch_size=32)
        mean, se = mean_and_se(scored["scores"])
        results[name] = {"accuracy": mean, "se": se, **{k: v for k, v in scored.items() if k != "answers"}}
        calls = f", {scored['tool_calls']:.2f} tool calls / episode" if tool else ""
        print(f"{name:10s} {mean:.3f} ± {se:.3f}{calls}", flush=True)
    for other in ("GRPO", "tool-SFT", "base+tool"):
        difference, se, n = paired_difference(results["GRPO+tool"]["scores"], results[other]["scores"])
        results[f"GRPO+tool - {other}"] = {
            "difference": difference,
            "se": se,
            "n": n,
            "verdict": verdict(difference, se),
        }
        print(f"GRPO+tool - {other}: {difference:+.3f} ± {se:.3f} (paired, n={n}): {verdict(difference, se)}")
    results["seconds"] = time.perf_counter() - started
    print(f"all: {results['seconds'] / 60:.1f} min")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
