"""``bench_lora memory``: the peak resident memory of one DPO or GRPO step on a preset, for LoRA with the
adapters-off reference, LoRA with a reference copy, and full fine-tuning with a copy; each variant in a fresh
process (``python -m benchmarks.bench_lora memory --variant ...``), under two glibc allocator settings."""

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

from benchmarks.lora.params import MIB, unique_parameters
from trainer.plan_check import resident_bytes

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("lora-shared", "lora-copy", "full-copy")
STEPS = ("dpo", "grpo")
STEP_MODULES = (
    "alignment.shared.losses", "alignment.shared.responses", "models.adapters", "models.generation", "models.loss",
    "trainer.optim",
)  # fmt: skip


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_models(args: argparse.Namespace, config=None):
    """(policy, reference or None: the policy with its adapters off) for the variant, seeded; ``config``: another
    model than the preset (the warm-up's)."""
    import copy

    import torch

    from models.adapters import add_adapters
    from models.model import ModelConfig, Transformer
    from models.model_config import PeftConfig

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
    warm_baseline, warm_up_peak = resident_bytes(), peak_rss()
    policy, reference = build_models(args)
    optimizer = optimizer_for(policy)
    after_models = resident_bytes()
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
