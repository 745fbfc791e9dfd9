"""Peak memory and time of the LM loss (forward + backward): full logits, checkpointed chunks, fused chunks.

Llama 3's vocabulary (V=128256) at T=4096: full fp32 logits alone are 2.1 GB per sequence, and autograd keeps
more copies of that size. Each variant runs in a fresh subprocess and reports its peak resident memory above
the memory held before the loss (inputs and weights), so the figure is what the loss itself costs. ``fused``
is what the model trains with (``models.loss.fused_linear_cross_entropy``); ``chunked`` is the activation-
checkpointed reference. Time ratios on a shared CPU are noisy: run it on an idle machine or on the GPU.
On CUDA (``--device cuda``) the figure is torch.cuda.max_memory_allocated above the same baseline.

    python -m benchmarks.bench_loss_memory [--vocab 128256 --seq-len 4096 --dim 2048 --chunk-size 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # each variant runs as `python -m benchmarks.bench_loss_memory` from here
VARIANTS = ("full", "chunked", "fused")


def peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_variant(args: argparse.Namespace) -> dict:
    import torch

    from models.loss import (
        chunked_cross_entropy,
        cross_entropy,
        fused_linear_cross_entropy,
    )

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hidden = torch.randn(1, args.seq_len, args.dim, device=args.device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(args.vocab, args.dim, device=args.device, dtype=dtype) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (1, args.seq_len), device=args.device)
    # Gradient buffers exist in any real step; allocate them before the baseline so they are not counted.
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = peak_bytes(args.device)
    start = time.perf_counter()
    if args.variant == "full":
        loss = cross_entropy(hidden @ weight.t(), targets)
    elif args.variant == "chunked":
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=args.chunk_size)
    else:
        loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=args.chunk_size)
    loss.backward()
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "variant": args.variant,
        "peak_gib": (peak_bytes(args.device) - baseline) / 2**30,
        "seconds": seconds,
        "loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    print(f"LM loss fwd+bwd, B=1 T={args.seq_len} V={args.vocab} dim={args.dim} {args.dtype} on {args.device}")
    print(f"(full fp32 logits would be {args.seq_len * args.vocab * 4 / 2**30:.2f} GiB)")
    results = []
    for variant in VARIANTS:
        cmd = [sys.executable, "-m", "benchmarks.bench_loss_memory", "--variant", variant] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "variant"
        ]
        output = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
    full = results[0]
    print(f"{'variant':<10}{'peak above inputs (GiB)':>26}{'seconds':>10}{'loss':>10}")
    for r in results:
        print(f"{r['variant']:<10}{r['peak_gib']:>26.2f}{r['seconds']:>10.1f}{r['loss']:>10.4f}")
    for r in results[1:]:
        print(
            f"{r['variant']} (chunk {args.chunk_size}) uses {full['peak_gib'] / max(r['peak_gib'], 1e-9):.1f}x less memory, "
            f"{r['seconds'] / full['seconds']:.2f}x the time; losses equal: {abs(full['loss'] - r['loss']) < 1e-3}"
        )


if __name__ == "__main__":
    main()
