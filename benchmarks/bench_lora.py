"""LoRA (peft) against full fine-tuning: what trains and what it holds, one alignment step's peak memory, and
held-out accuracy after SFT. Three parts, each a subcommand; every part prints its table and updates its entry of
benchmarks/results/lora.json (``--json``).

    python -m benchmarks.bench_lora params   # exact counts on the meta device, no memory: small, Llama 3.2 1B, 3.1 8B
    python -m benchmarks.bench_lora memory   # peak RSS of one DPO and one GRPO step on `small`, CPU fp32, 3 variants
    python -m benchmarks.bench_lora heldout  # the demo pipeline's SFT, full vs LoRA, 400 held-out prompts, paired

``params``: LoRA r=16 on the blocks' seven projections (wq wk wv wo w1 w2 w3) added with ``models.adapters.add_adapters``
to a model built on the meta device; tied embeddings count once. Training state = weights + gradients + AdamW's two
moments, all fp32 (16 bytes per trained parameter, 4 per frozen one); the "bf16 base" column keeps LoRA's frozen base
in bf16 (2 bytes per frozen parameter). Gradients and AdamW moments exist only for what trains.

``memory``: each variant of each step runs in a fresh subprocess and reports its peak resident memory
(``ru_maxrss``) above the resident size after the imports and a warm-up step on a one-layer model (the first call
of each kernel and the threads take ~20 MiB once per process; the figure above the post-import peak is kept as
``cold_peak_mib``), so the figure holds the weights, the reference, gradients, AdamW's moments and the step's
activations. Each runs twice: with glibc's mmap threshold fixed at 128 KiB, so that the resident size follows the
live tensors (the table's figure), and with glibc's default, whose heap fragmentation adds what a plain run on this
machine really holds. ``saved`` is what autograd saves for backward in the policy's pass (saved-tensor hooks, each
storage once, parameters left out). Variants: ``lora-shared`` (LoRA, the
reference is the same model with its adapters off: ``models.adapters.adapters_disabled``), ``lora-copy`` (LoRA, a
frozen ``copy.deepcopy`` of the base as the reference), ``full-copy`` (every weight trains, a frozen copy as the
reference: the default without peft). One step is built from the library's pieces as the stages use them: DPO =
policy forward + backward over chosen + rejected rows (``Transformer.token_losses``, fused with the head), a no-grad
reference forward (``loss.reference_logprobs=on_the_fly``), ``preference_loss``, an AdamW step over what trains
(``trainer.optim.build_optimizer``); GRPO = a group sampled with the KV cache (``models.generation.generate``), old and
reference log-probs without grad (``alignment.shared.responses.response_logprobs``), ``group_advantages`` of random
scores, the policy's forward + backward (``ppo_policy_loss`` + k3 ``kl_penalty``) and an AdamW step. ``--label``
stores another shape beside the default one; the PNG (results/lora_memory.png) draws every stored shape.

``heldout``: runs (or reuses) ``lantern pipeline configs/pipeline/default.yaml stages=[prepare,pretrain,sft]``, then
the same SFT stage (its resolved config.yaml) with ``peft.kind=lora`` at each ``--lora`` setting, and scores every
model as benchmarks/score_models.py does (the report's scoring: greedy and sampled accuracy and pass@k on the same
400 held-out prompts, each paired with the pipeline's full-SFT model, a gain or a loss only beyond 2 SE; each
model's result cached in its run folder), and each model's loss on the val answers' end-of-turn token and other
tokens. A run or score already made is reused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.lora.heldout import print_heldout, run_heldout
from benchmarks.lora.memory import STEPS, VARIANTS, plot_memory, run_memory, run_variant
from benchmarks.lora.params import run_params

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "lora.json"
PRESETS = ("small", "llama3.2-1b", "llama3.1-8b")
DEFAULT_LORA_RUNS = (  # NAME:RANK:ALPHA:LR; alpha / rank = 2 throughout; the full SFT's lr is 1e-3
    "lora-r16:16:32:1e-2", "lora-r64:64:128:1e-2", "lora-r16-lr3e-3:16:32:3e-3", "lora-r64-lr3e-3:64:128:3e-3",
    "lora-r16-lr1e-3:16:32:1e-3",
)  # fmt: skip


def update_results(path: Path, part: str, value: Any) -> None:
    """Write ``value`` as ``part`` of the JSON file, keeping the other parts' last results."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[part] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def machine() -> dict[str, Any]:
    import os
    import platform

    import torch

    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", type=Path, default=RESULTS, help="results file (default %(default)s)")
    parts = parser.add_subparsers(dest="part", required=True)

    params = parts.add_parser("params", help="trainable parameters and training-state bytes (meta device)")
    params.add_argument("--presets", nargs="+", default=list(PRESETS))
    params.add_argument("--rank", type=int, default=16)
    params.add_argument("--alpha", type=float, default=32.0)

    memory = parts.add_parser("memory", help="peak RSS of one DPO and one GRPO step, three variants")
    memory.add_argument("--preset", default="small")
    memory.add_argument("--rank", type=int, default=16)
    memory.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    memory.add_argument("--pairs", type=int, default=8, help="DPO: pairs (2x rows)")
    memory.add_argument("--seq-len", type=int, default=256, help="DPO: tokens a row")
    memory.add_argument("--prompt-len", type=int, default=64, help="tokens of a prompt (DPO and GRPO)")
    memory.add_argument("--prompts", type=int, default=4, help="GRPO: prompts a rollout")
    memory.add_argument("--group", type=int, default=8, help="GRPO: responses per prompt")
    memory.add_argument("--new-tokens", type=int, default=64, help="GRPO: tokens generated per response")
    memory.add_argument(
        "--chunk-size", type=int, default=1024, help="DPO: the fused loss's chunk (trainer.loss_chunk_size)"
    )
    memory.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    memory.add_argument("--repeat", type=int, default=2, help="steps taken (the peak is over all; default 2: AdamW's "
                        "moments exist from the second on)")  # fmt: skip
    memory.add_argument("--label", default="", help="store the results as memory:LABEL (e.g. another shape)")
    memory.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)

    heldout = parts.add_parser("heldout", help="held-out accuracy of LoRA SFT vs full SFT on the demo pipeline")
    heldout.add_argument("--pipeline", default="runs/lora-bench/pipeline", help="pipeline folder (made if missing)")
    heldout.add_argument("--config", default="configs/pipeline/default.yaml")
    heldout.add_argument("--lora-dir", default=None, help="LoRA runs' folder (default: PIPELINE/../lora)")
    heldout.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME:RANK:ALPHA:LR",
        help="a LoRA SFT run (repeatable; default: the five of docs/lora.md, r 16 and 64 at lr 1e-2 and 3e-3, r 16 at 1e-3)",
    )
    args = parser.parse_args(argv)

    if args.part == "memory" and args.variant:  # one variant, in its own process
        args.step = args.steps[0]
        print(json.dumps(run_variant(args)))
        return
    if args.part == "params":
        result = run_params(args)
    elif args.part == "memory":
        result = run_memory(args)
    else:
        args.lora = args.lora or list(DEFAULT_LORA_RUNS)
        result = run_heldout(args)
        print_heldout(result)
    result["machine"] = machine()
    part = f"memory:{args.label}" if args.part == "memory" and args.label else args.part
    update_results(args.json, part, result)
    print(f"\nwrote {args.json} ({part})")
    if args.part == "memory":
        plot = args.json.with_name(args.json.stem + "_memory.png")
        plot_memory(json.loads(args.json.read_text()), plot)
        print(f"wrote {plot}")


if __name__ == "__main__":
    main()
