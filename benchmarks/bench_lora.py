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
import importlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "lora.json"
PRESETS = ("small", "llama3.2-1b", "llama3.1-8b")
VARIANTS = ("lora-shared", "lora-copy", "full-copy")
STEPS = ("dpo", "grpo")
DEFAULT_LORA_RUNS = (  # NAME:RANK:ALPHA:LR; alpha / rank = 2 throughout; the full SFT's lr is 1e-3
    "lora-r16:16:32:1e-2", "lora-r64:64:128:1e-2", "lora-r16-lr3e-3:16:32:3e-3", "lora-r64-lr3e-3:64:128:3e-3",
    "lora-r16-lr1e-3:16:32:1e-3",
)  # fmt: skip
GIB, MIB = 2**30, 2**20
STEP_MODULES = (
    "alignment.shared.losses", "alignment.shared.responses", "models.adapters", "models.generation", "models.loss",
    "trainer.optim",
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


# ---------------------------------------------------------------------------------------------------------
# params: exact counts, no memory


def unique_parameters(model) -> list:
    seen, params = set(), []
    for parameter in model.parameters():
        if id(parameter) not in seen:  # a tied embedding is one tensor under two names
            seen.add(id(parameter))
            params.append(parameter)
    return params


def count_preset(preset: str | dict, rank: int, alpha: float) -> dict[str, Any]:
    """Parameters and training-state bytes of full fine-tuning and of LoRA, for a preset name or a model dict."""
    import torch

    from models.adapter_config import PeftConfig
    from models.adapters import add_adapters
    from models.model import ModelConfig, Transformer

    config = ModelConfig.from_dict(preset) if isinstance(preset, dict) else ModelConfig.from_preset(preset)
    with torch.device("meta"):
        model = Transformer(config)
        base = sum(p.numel() for p in unique_parameters(model))
        add_adapters(model, PeftConfig(kind="lora", rank=rank, alpha=alpha))
    params = unique_parameters(model)
    lora = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    assert frozen == base, (frozen, base)
    fp32, bf16 = 4, 2
    full = {"weights": fp32 * base, "grads": fp32 * base, "adam": 2 * fp32 * base}
    adapters = {
        "weights": fp32 * (base + lora),
        "grads": fp32 * lora,
        "adam": 2 * fp32 * lora,
        "weights_bf16_base": bf16 * base + fp32 * lora,
    }
    full["total"] = full["weights"] + full["grads"] + full["adam"]
    adapters["total"] = adapters["weights"] + adapters["grads"] + adapters["adam"]
    adapters["total_bf16_base"] = adapters["weights_bf16_base"] + adapters["grads"] + adapters["adam"]
    return {
        "preset": preset if isinstance(preset, str) else "model",
        "tie_embeddings": config.tie_embeddings,
        "base_params": base,
        "lora_params": lora,
        "trainable_pct": 100 * lora / base,
        "full_bytes": full,
        "lora_bytes": adapters,
        # gradients + AdamW moments: what exists only for trained parameters
        "grad_adam_pct_of_full": 100 * (adapters["grads"] + adapters["adam"]) / (full["grads"] + full["adam"]),
        "total_pct_of_full": 100 * adapters["total"] / full["total"],
        "total_bf16_base_pct_of_full": 100 * adapters["total_bf16_base"] / full["total"],
    }


def run_params(args: argparse.Namespace) -> dict[str, Any]:
    rows = [count_preset(preset, args.rank, args.alpha) for preset in args.presets]
    print(f"LoRA r={args.rank} (alpha {args.alpha:g}) on wq wk wv wo w1 w2 w3 vs full fine-tuning; fp32 weights, "
          "fp32 gradients, 2 fp32 AdamW moments (bf16 base: LoRA's frozen base in bf16)")  # fmt: skip
    head = (
        f"{'preset':<13}{'params':>15}{'LoRA params':>13}{'trained':>9}{'grad+Adam full':>16}{'grad+Adam LoRA':>16}"
        f"{'LoRA/full':>10}{'state full':>12}{'state LoRA':>12}{'(bf16 base)':>12}"
    )
    print(head)
    for r in rows:
        full, lora = r["full_bytes"], r["lora_bytes"]
        print(
            f"{r['preset']:<13}{r['base_params']:>15,}{r['lora_params']:>13,}{r['trainable_pct']:>8.2f}%"
            f"{size(full['grads'] + full['adam']):>16}{size(lora['grads'] + lora['adam']):>16}"
            f"{r['grad_adam_pct_of_full']:>9.2f}%{size(full['total']):>12}{size(lora['total']):>12}"
            f"{size(lora['total_bf16_base']):>12}"
        )
    return {"rank": args.rank, "alpha": args.alpha, "targets": "wq wk wv wo w1 w2 w3", "presets": rows}


def size(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.1f} MiB"


# ---------------------------------------------------------------------------------------------------------
# memory: one DPO or GRPO step in a fresh process


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_models(args: argparse.Namespace, config=None):
    """(policy, reference or None: the policy with its adapters off) for the variant, seeded; ``config``: another
    model than the preset (the warm-up's)."""
    import copy

    import torch

    from models.adapter_config import PeftConfig
    from models.adapters import add_adapters
    from models.model import ModelConfig, Transformer

    torch.manual_seed(0)
    policy = Transformer(config or ModelConfig.from_preset(args.preset))
    reference = None
    if args.variant != "lora-shared":
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if args.variant.startswith("lora"):
        add_adapters(policy, PeftConfig(kind="lora", rank=args.rank, alpha=2.0 * args.rank))
        # LoRA's B starts at zero (policy = reference); a step taken from a trained adapter is what a run does
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.01)
    policy.train()
    return policy, reference


def reference_context(policy, reference):
    """Where the reference pass runs: the frozen copy, or the policy with its adapters off."""
    from contextlib import nullcontext

    from models.adapters import adapters_disabled

    return (reference, nullcontext()) if reference is not None else (policy, adapters_disabled(policy))


class SavedForBackward:
    """The bytes autograd saves for backward in a pass (every storage once, the parameters left out): the
    activations the step holds between its forward and its backward."""

    def __init__(self, model) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in self.parameters:
            self.storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self):
        import torch

        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    @property
    def mib(self) -> float:
        return sum(self.storages.values()) / MIB


def optimizer_for(policy):
    from trainer.optim import build_optimizer

    optimizer, _ = build_optimizer(
        policy, lr=1e-4, min_lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, warmup_steps=0, max_steps=1
    )  # parameter_groups: only what requires grad
    return optimizer


def dpo_step(args: argparse.Namespace, policy, reference, optimizer) -> dict[str, float]:
    import torch

    from alignment.shared.losses import preference_loss
    from models.loss import IGNORE_INDEX

    generator = torch.Generator().manual_seed(1)
    rows, length, vocab = 2 * args.pairs, args.seq_len, policy.config.vocab_size
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    targets = torch.roll(input_ids, -1, dims=1)
    targets[:, : args.prompt_len - 1] = IGNORE_INDEX  # the response tokens only, as the DPO batches hold
    targets[:, -1] = IGNORE_INDEX
    timings = {}
    start = time.perf_counter()
    with SavedForBackward(policy) as saved:
        policy_sums = -policy.token_losses(input_ids, targets, chunk_size=args.chunk_size).sum(-1)
    model, context = reference_context(policy, reference)
    with torch.no_grad(), context:
        reference_sums = -model.token_losses(input_ids, targets, chunk_size=args.chunk_size).sum(-1)
    chosen, rejected = policy_sums.chunk(2)
    ref_chosen, ref_rejected = reference_sums.chunk(2)
    losses, _, _ = preference_loss(chosen, rejected, ref_chosen, ref_rejected, kind="dpo", beta=0.1)
    loss = losses.mean()
    timings["forward"] = time.perf_counter() - start
    loss.backward()
    timings["backward"] = time.perf_counter() - start - timings["forward"]
    optimizer.step()
    optimizer.zero_grad()
    timings["step_seconds"] = time.perf_counter() - start
    return {"loss": float(loss.detach()), "saved_activations_mib": saved.mib, **timings}


def grpo_step(args: argparse.Namespace, policy, reference, optimizer) -> dict[str, float]:
    import torch

    from alignment.shared.losses import group_advantages, kl_penalty, ppo_policy_loss
    from alignment.shared.responses import response_logprobs
    from models.generation import generate, left_pad

    generator = torch.Generator().manual_seed(1)
    vocab, temperature = policy.config.vocab_size, 1.0
    prompts = torch.randint(1, vocab, (args.prompts, args.prompt_len), generator=generator).tolist()
    group = [p for p in prompts for _ in range(args.group)]  # each prompt's responses side by side
    start = time.perf_counter()
    out = generate(
        policy, group, max_new_tokens=args.new_tokens, temperature=temperature, pad_id=0, generator=generator
    )
    generation = time.perf_counter() - start
    prompt_ids, prompt_real = left_pad(group, 0)
    input_ids, real = torch.cat([prompt_ids, out.tokens], 1), torch.cat([prompt_real, out.mask], 1)
    P, mask = prompt_ids.shape[1], out.mask
    model, context = reference_context(policy, reference)
    with torch.no_grad():
        old_logp = response_logprobs(policy, input_ids, real, P, temperature)[0]
        with context:
            ref_logp = response_logprobs(model, input_ids, real, P, temperature)[0]
        scores = torch.rand(args.prompts, args.group, generator=generator)  # the reward's scores: any will do
        advantages = group_advantages(scores).flatten()
    token_advantages = advantages[:, None].expand_as(mask).float()
    tokens = mask.sum().clamp(min=1).float()
    with SavedForBackward(policy) as saved:
        logp, _ = response_logprobs(policy, input_ids, real, P, temperature)
    policy_loss, _ = ppo_policy_loss(logp, old_logp, token_advantages, mask, 0.2, tokens)
    kl = torch.where(mask, kl_penalty(logp, ref_logp, "k3"), 0.0)
    loss = policy_loss + (0.04 * kl * mask).sum() / tokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return {
        "loss": float(loss.detach()),
        "saved_activations_mib": saved.mib,
        "generation_seconds": generation,
        "response_tokens": int(mask.sum()),
        "step_seconds": time.perf_counter() - start,
    }


def current_rss() -> int:
    import os

    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_memory() -> None:
    """Hand glibc's freed heap back to the kernel, so that the resident size is what is still in use."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def warm_up(args: argparse.Namespace, step) -> None:
    """The same step once on a one-layer, 64-wide model with a few tokens: the first call of each kernel, the
    autograd engine's and OpenMP's threads and oneDNN's caches take memory once per process, whatever the model."""
    import copy

    from models.model import ModelConfig

    small = copy.copy(args)
    small.pairs, small.seq_len, small.prompt_len, small.prompts, small.group, small.new_tokens = 1, 16, 4, 1, 2, 4
    config = ModelConfig(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=256, multiple_of=32, max_seq_len=64)
    policy, reference = build_models(small, config)
    optimizer = optimizer_for(policy)
    for _ in range(args.repeat):
        step(small, policy, reference, optimizer)


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch

    for module in STEP_MODULES:  # imported before the baseline, so that the figure holds no import
        importlib.import_module(module)
    if args.threads:
        torch.set_num_threads(args.threads)
    step = dpo_step if args.step == "dpo" else grpo_step
    cold_baseline = peak_rss()  # after the imports
    warm_up(args, step)
    gc.collect()
    release_free_memory()
    warm_baseline, warm_up_peak = current_rss(), peak_rss()
    policy, reference = build_models(args)
    optimizer = optimizer_for(policy)
    after_models = current_rss()
    # AdamW makes its moments at its first step: from the second on, a step's peak is a training run's
    steps = [step(args, policy, reference, optimizer) for _ in range(args.repeat)]
    peak = peak_rss()
    result = {**steps[-1], "first_step_seconds": steps[0]["step_seconds"], "steps": args.repeat}
    trained = sum(p.numel() for p in unique_parameters(policy) if p.requires_grad)
    policy_weights = sum(p.numel() for p in unique_parameters(policy))
    reference_weights = 0 if reference is None else sum(p.numel() for p in unique_parameters(reference))
    return {
        "step": args.step,
        "variant": args.variant,
        # what the step needs: the peak above what the process held after a warm-up step on a one-layer model
        "peak_mib": (peak - warm_baseline) / MIB,
        # the peak above the post-import baseline: also the one-off memory of the first kernels and threads
        "cold_peak_mib": (peak - cold_baseline) / MIB,
        "warm_up_overhead_mib": (warm_baseline - cold_baseline) / MIB,
        "peak_reached_in_warm_up": peak == warm_up_peak,
        "models_mib": (after_models - warm_baseline) / MIB,
        "post_import_rss_mib": cold_baseline / MIB,
        "policy_params": policy_weights,
        "reference_params": reference_weights,
        "trained_params": trained,
        **result,
    }


def breakdown(r: dict[str, Any]) -> dict[str, float]:
    """The peak's back-of-envelope parts (MiB, fp32): weights, reference copy, gradients, AdamW moments, and the
    rest (activations, the logits' chunks, the KV cache, allocator slack)."""
    parts = {
        "weights": 4 * r["policy_params"] / MIB,
        "reference": 4 * r["reference_params"] / MIB,
        "grads": 4 * r["trained_params"] / MIB,
        "adam": 8 * r["trained_params"] / MIB,
    }
    parts["activations_and_rest"] = r["peak_mib"] - sum(parts.values())
    return parts


# glibc's default: a freed block above the mmap threshold raises the threshold (up to 32 MiB), so the activations'
# blocks land on the heap and what fragments there stays resident. A fixed threshold maps every block above 128 KiB
# on its own and unmaps it when freed: the resident size then follows the live tensors.
ALLOCATORS = {"fixed-mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "glibc-default": {}}


def run_memory(args: argparse.Namespace) -> dict[str, Any]:
    import os

    shape = {
        "dpo": f"{args.pairs} pairs x {args.seq_len} tokens (prompt {args.prompt_len}), fused chunked loss",
        "grpo": f"{args.prompts} prompts x group {args.group}, prompt {args.prompt_len} + {args.new_tokens} new tokens",
    }
    print(f"one step's peak RSS above the RSS after a warm-up step on a one-layer model, {args.preset}, CPU fp32, "
          f"LoRA r={args.rank}, each variant in a fresh process; glibc with a fixed mmap threshold (the live "
          "tensors) and with its default (what a plain run holds)")  # fmt: skip
    results = []
    for step in args.steps:
        for variant in VARIANTS:
            cmd = [
                sys.executable, "-m", "benchmarks.bench_lora", "memory", "--variant", variant, "--steps", step,
                "--preset", args.preset, "--rank", str(args.rank), "--pairs", str(args.pairs),
                "--seq-len", str(args.seq_len), "--prompt-len", str(args.prompt_len), "--prompts", str(args.prompts),
                "--group", str(args.group), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
                "--chunk-size", str(args.chunk_size), "--repeat", str(args.repeat),
            ]  # fmt: skip
            runs = {}
            for allocator, settings in ALLOCATORS.items():
                env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | settings
                wall = time.perf_counter()
                done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, env=env)
                runs[allocator] = json.loads(done.stdout.strip().splitlines()[-1])
                runs[allocator]["process_seconds"] = time.perf_counter() - wall
            result = runs["fixed-mmap"]
            result["glibc_default"] = {
                key: runs["glibc-default"][key] for key in ("peak_mib", "cold_peak_mib", "step_seconds", "loss")
            }
            result["breakdown_mib"] = breakdown(result)
            results.append(result)
            print(
                f"  {step} {variant}: {result['peak_mib']:.0f} MiB (glibc default "
                f"{result['glibc_default']['peak_mib']:.0f}), step {result['step_seconds']:.1f} s",
                flush=True,
            )
    print(f"\n{'step':<6}{'variant':<13}{'peak MiB':>10}{'weights':>9}{'ref':>7}{'grads':>7}{'Adam':>7}"
          f"{'activ.+rest':>13}{'saved':>7}{'glibc default':>15}{'step s':>8}")  # fmt: skip
    for r in results:
        b = r["breakdown_mib"]
        print(
            f"{r['step']:<6}{r['variant']:<13}{r['peak_mib']:>10.0f}{b['weights']:>9.0f}{b['reference']:>7.0f}"
            f"{b['grads']:>7.0f}{b['adam']:>7.0f}{b['activations_and_rest']:>13.0f}{r['saved_activations_mib']:>7.0f}"
            f"{r['glibc_default']['peak_mib']:>15.0f}{r['step_seconds']:>8.1f}"
        )
    ratios = {}
    for step in args.steps:
        for name, peak in (("", lambda r: r["peak_mib"]), ("_glibc_default", lambda r: r["glibc_default"]["peak_mib"])):
            peaks = {r["variant"]: peak(r) for r in results if r["step"] == step}
            ratios.setdefault(step, {}).update({
                f"lora_shared_over_lora_copy{name}": peaks["lora-shared"] / peaks["lora-copy"],
                f"lora_shared_over_full_copy{name}": peaks["lora-shared"] / peaks["full-copy"],
            })  # fmt: skip
        q = ratios[step]
        print(
            f"{step}: lora-shared / lora-copy = {q['lora_shared_over_lora_copy']:.2f}x "
            f"(glibc default {q['lora_shared_over_lora_copy_glibc_default']:.2f}x), lora-shared / full-copy = "
            f"{q['lora_shared_over_full_copy']:.2f}x (glibc default {q['lora_shared_over_full_copy_glibc_default']:.2f}x)"
        )
    return {
        "preset": args.preset,
        "rank": args.rank,
        "threads": args.threads,
        "steps_per_run": args.repeat,
        "allocators": ALLOCATORS,
        "shapes": {step: shape[step] for step in args.steps},
        "results": results,
        "ratios": ratios,
    }


def plot_memory(data: dict[str, Any], path: Path) -> None:
    """Every memory part of the results file (one panel per shape): each variant's peak as stacked parts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = {key: value for key, value in data.items() if key.startswith("memory")}
    figure, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    colors = {"weights": "#4c72b0", "reference": "#8172b2", "grads": "#dd8452", "adam": "#c44e52"}
    for axis, part in zip(axes[0], parts.values()):
        labels = [f"{r['step']}\n{r['variant']}" for r in part["results"]]
        bottom = [0.0] * len(labels)
        for name in (*colors, "activations_and_rest"):
            values = [max(r["breakdown_mib"][name], 0.0) for r in part["results"]]
            axis.bar(labels, values, bottom=bottom, label=name.replace("_", " "), color=colors.get(name, "#55a868"))
            bottom = [b + v for b, v in zip(bottom, values)]
        axis.scatter(labels, [r["glibc_default"]["peak_mib"] for r in part["results"]], color="black", marker="_",
                     s=400, label="peak, glibc default", zorder=3)  # fmt: skip
        shapes = "\n".join(f"{step}: {shape}" for step, shape in part["shapes"].items())
        axis.set_title(f"{part['preset']}, CPU fp32, LoRA r={part['rank']}\n{shapes}", fontsize=8)
        axis.set_ylabel("peak RSS above the warm baseline (MiB)")
        axis.tick_params(axis="x", labelsize=7)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------------------
# heldout: the demo pipeline's SFT, full vs LoRA


def parse_lora(spec: str) -> dict[str, Any]:
    """NAME:RANK:ALPHA:LR, e.g. lora-r16:16:32:1e-2."""
    try:
        name, rank, alpha, lr = spec.split(":")
        return {"name": name, "rank": int(rank), "alpha": float(alpha), "lr": float(lr)}
    except ValueError:
        raise SystemExit(f"--lora expects NAME:RANK:ALPHA:LR, got {spec!r}") from None


def timed(cmd: list[str], log: Path) -> float:
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with log.open("w") as handle:
        status = subprocess.run(cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT).returncode
    if status:
        raise SystemExit(f"exit {status}: see {log}")
    return time.perf_counter() - start


def run_heldout(args: argparse.Namespace) -> dict[str, Any]:
    pipeline = Path(args.pipeline).resolve()
    lora_root = Path(args.lora_dir).resolve() if args.lora_dir else pipeline.parent / "lora"
    lora_root.mkdir(parents=True, exist_ok=True)
    lantern = [sys.executable, "-m", "alignment.commands.cli"]
    walls: dict[str, float] = {}
    if not (pipeline / "sft" / "final" / "lantern.json").is_file():
        pipeline.parent.mkdir(parents=True, exist_ok=True)
        walls["pipeline (prepare, pretrain, full sft)"] = timed(
            [
                *lantern,
                "pipeline",
                args.config,
                "stages=[prepare,pretrain,sft]",
                f"out_dir={pipeline}",
                "logger.kind=csv",
            ],
            pipeline.parent / "pipeline.log",
        )
    sft_config = pipeline / "sft" / "config.yaml"
    models, settings = {}, {}
    for lora in map(parse_lora, args.lora):
        run = lora_root / lora["name"]
        settings[lora["name"]] = lora
        if not (run / "final" / "lantern.json").is_file():
            walls[lora["name"]] = timed(
                [
                    *lantern,
                    "sft",
                    str(sft_config),
                    f"run.out_dir={lora_root}",
                    f"run.name={lora['name']}",
                    "peft.kind=lora",
                    f"peft.rank={lora['rank']}",
                    f"peft.alpha={lora['alpha']}",
                    f"optim.lr={lora['lr']}",
                    f"optim.min_lr={lora['lr'] / 10}",
                    "logger.kind=csv",
                ],
                lora_root / f"{lora['name']}.log",
            )
        models[lora["name"]] = run / "final"
    start = time.perf_counter()
    scored = score_beside_sft(args.config, pipeline, models)
    walls["scoring"] = time.perf_counter() - start
    finals = {"base": pipeline / "pretrain" / "final", "sft": pipeline / "sft" / "final", **models}
    losses = answer_losses(pipeline / "data" / "demo" / "val.jsonl", load_yaml(sft_config)["data"]["tokenizer"], finals)
    full = load_yaml(sft_config)
    trained = {"sft": count_preset(full["model"], 16, 32.0)["base_params"]}
    trained.update(
        {name: count_preset(full["model"], s["rank"], s["alpha"])["lora_params"] for name, s in settings.items()}
    )
    report = json.loads((pipeline / "report.json").read_text()) if (pipeline / "report.json").is_file() else {}
    stage_seconds = {stage: r.get("seconds") for stage, r in report.get("stages", {}).items()}
    return {
        "full_lr": full["optim"]["lr"],
        # training time of each run, from its folder (config.yaml written at the start, final/ at the end), so that
        # runs made by an earlier invocation keep theirs; the pipeline's stages as its report has them
        "run_seconds": {"pretrain": stage_seconds.get("pretrain"), "sft": stage_seconds.get("sft")}
        | {name: folder_seconds(path.parent) for name, path in models.items()},
        "trained_params": trained,
        "pipeline": str(pipeline),
        "lora_runs": str(lora_root),
        "settings": settings,
        "wall_seconds": walls,
        "heldout_prompts": scored["heldout_prompts"],
        "results": scored["results"],
        "answer_loss": losses,
    }


def score_beside_sft(config_path: str, pipeline: Path, models: dict[str, Path]) -> dict[str, Any]:
    """benchmarks/score_models.py's scoring (the pipeline report's: greedy and sampled accuracy, pass@k, each model
    paired with the pipeline's SFT model), with each model's result cached in its folder's parent under the
    folder's fingerprint, so that an interrupted run scores only what is left."""
    from alignment.commands.pipeline import Pipeline, load_pipeline_config
    from alignment.commands.pipeline_eval import compare_with_sft, evaluate_stage, heldout_prompts, without_per_prompt
    from alignment.shared.evaluation import json_safe
    from data.tokenizer.tokenizer import Tokenizer
    from models.digests import content_key, folder_fingerprint

    config = load_pipeline_config(config_path, [f"out_dir={pipeline}", "logger.kind=csv"])
    config.start_checkpoint = None
    runner = Pipeline(config)
    runner.write_demo(only_if_current=True)  # refuses demo data written with other settings
    sft = runner.stage_dir("sft") / "final"
    tokenizer = Tokenizer.load(runner.load_stage_config("sft")[0].data.tokenizer)
    prompts = heldout_prompts(runner.demo, config.report, tokenizer)
    results = {}
    for name, path in {"sft": sft, **models}.items():
        cache = path.parent / "bench_lora_score.json"
        key = content_key(folder_fingerprint(path), folder_fingerprint(sft), runner.demo_hash, str(config.report))
        cached = json.loads(cache.read_text()) if cache.is_file() else {}
        if cached.get("key") == key:
            results[name] = cached["result"]
            continue
        results[name] = json_safe(
            evaluate_stage(config.report, name, path, prompts, tokenizer, None if name == "sft" else sft)
        )
        cache.write_text(json.dumps({"key": key, "result": results[name]}) + "\n")
    compare_with_sft(results)
    return {
        "heldout_prompts": len(prompts),
        "results": {name: without_per_prompt(result) for name, result in results.items()},
    }


def answer_losses(val: Path, tokenizer_spec: str, finals: dict[str, Path], limit: int = 400) -> dict[str, Any]:
    """Each model's mean loss (nats) on the supervised tokens of the demo's val conversations, split into the
    end-of-turn token (<|eot_id|>: a token pretraining never saw, whose embedding and LM-head row LoRA cannot change)
    and the answers' other tokens."""
    import torch

    from data.tokenizer.tokenizer import Tokenizer
    from models.checkpoint import load_checkpoint

    tokenizer = Tokenizer.load(tokenizer_spec)
    rows = [json.loads(line) for line in val.read_text().splitlines()[:limit]]
    encoded = [tokenizer.encode_chat(row["messages"]) for row in rows]
    result = {}
    for name, path in finals.items():
        model = load_checkpoint(path, dtype=torch.float32).eval()
        sums = {"eot": [0.0, 0], "other": [0.0, 0]}
        with torch.no_grad():
            for ids, mask in encoded:
                ids = torch.tensor(ids[: model.config.max_seq_len + 1])
                supervised = torch.tensor(mask[: len(ids)])[1:]
                targets = ids[1:]
                nll = -torch.log_softmax(model(ids[None, :-1])[0], -1).gather(-1, targets[:, None])[:, 0]
                for key, where in (("eot", targets == tokenizer.eot_id), ("other", targets != tokenizer.eot_id)):
                    sums[key][0] += float(nll[supervised & where].sum())
                    sums[key][1] += int((supervised & where).sum())
        result[name] = {key: {"loss": total / max(n, 1), "tokens": n} for key, (total, n) in sums.items()}
    return result


def folder_seconds(run: Path) -> float:
    return (run / "final" / "lantern.json").stat().st_mtime - (run / "config.yaml").stat().st_mtime


def load_yaml(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


# ---------------------------------------------------------------------------------------------------------


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


def print_heldout(result: dict[str, Any]) -> None:
    print("\nloss on the val answers' supervised tokens (nats): <|eot_id|> / the other tokens")
    for name, parts in result.get("answer_loss", {}).items():
        print(f"  {name:<16}{parts['eot']['loss']:>7.2f} / {parts['other']['loss']:.2f}")
    print(f"\n{result['heldout_prompts']} held-out prompts; every model paired with the full SFT model (2-SE verdict)")
    print(f"{'model':<16}{'rank':>5}{'lr':>8}{'trained':>11}  {'greedy':<15}{'vs full SFT':<36}"
          f"{'sampled':<15}{'vs full SFT':<36}{'train s':>8}")  # fmt: skip
    for name, r in result["results"].items():
        setting = result["settings"].get(name, {"rank": "-", "lr": result.get("full_lr", "-")})
        trained = result.get("trained_params", {}).get(name) or 0
        print(
            f"{name:<16}{setting['rank']!s:>5}{setting['lr']!s:>8}{trained:>11,}  {fmt(r.get('heldout')):<15}"
            f"{paired(r.get('vs_sft')):<36}{fmt(r.get('sampled')):<15}{paired(r.get('vs_sft_sampled')):<36}"
            f"{result.get('run_seconds', {}).get(name) or 0:>8.0f}"
        )


def fmt(summary: dict[str, Any] | None) -> str:
    return "-" if not summary else f"{summary['accuracy']:.3f} ± {summary['se']:.3f}"


def paired(comparison: dict[str, Any] | None) -> str:
    if not comparison:
        return "-"
    return f"{comparison['difference']:+.3f} ± {comparison['se']:.3f} {comparison['verdict']}"


if __name__ == "__main__":
    main()
