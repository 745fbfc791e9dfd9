"""Decode throughput: eager KV cache vs static KV cache vs static + compiled decode step (and recomputation).

    python -m benchmarks.bench_generation --preset tiny                     # CPU, batch 1 and 8
    python -m benchmarks.bench_generation --device cuda --dtype bfloat16 --preset llama3.2-1b --batch-sizes 1,64 --json gen.json

Greedy decoding of a randomly initialised model on random prompts (speed does not depend on the weights), no
stop ids, so every row produces exactly --new-tokens tokens. Modes (``models.generation.generate``):
  eager     the default KV-cache path (the cache is read up to its current length: shapes change every step)
  static    static_cache=True: a fixed-size reused cache read whole under a mask (one shape for every step)
  compiled  compile=True: the static step under torch.compile(mode="reduce-overhead"), i.e. CUDA graphs on CUDA
  recompute use_cache=False, the whole sequence every step (--recompute; slow, the correctness reference)
Each (mode, batch) is run once untimed (compilation, CUDA-graph capture, allocator growth), then timed over
--repeats runs (best kept); timings include the prefill and are synchronised on CUDA. tok/s counts generated
tokens over all rows. "same" says whether the mode's tokens equal the eager path's (greedy, so they should;
in bf16 a near-tie can flip, since the static path reduces over a longer, masked key range).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from models.generation import generate
from models.model import ModelConfig, Transformer

MODES = {
    "eager": {"decode": "eager"},  # explicit: the default, auto, is compiled on CUDA
    "static": {"static_cache": True},
    "compiled": {"compile": True},
    "recompute": {"use_cache": False},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_mode(
    model: Transformer, prompts: torch.Tensor, new_tokens: int, mode: str, repeats: int
) -> tuple[float, torch.Tensor]:
    """Best wall time over ``repeats`` timed runs after one untimed run, and the tokens."""
    device = prompts.device

    def once() -> torch.Tensor:
        out = generate(model, prompts, max_new_tokens=new_tokens, temperature=0, **MODES[mode])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        assert out.tokens.shape == (prompts.shape[0], new_tokens)
        return out.tokens

    tokens = once()  # warm-up: compile / capture / allocate
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = once()
        best = min(best, time.perf_counter() - start)
    return best, tokens


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--batch-sizes must be integers >= 1, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="model preset in configs/model (default: small)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated, e.g. 1,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--modes", default="eager,static,compiled", help=f"comma-separated of {','.join(MODES)}")
    parser.add_argument("--recompute", action="store_true", help="also time use_cache=False (slow)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    modes = [m for m in args.modes.split(",") if m] + (["recompute"] if args.recompute else [])
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if "eager" not in modes:
        modes.insert(0, "eager")  # the baseline every ratio is taken against
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = ModelConfig.from_preset(args.preset)
    with device:  # build on the device: a 1B model initialised on CPU first would take a while
        model = Transformer(config)
    model = model.to(DTYPES[args.dtype]).eval()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    print(
        f"preset={args.preset} params={model.num_params() / 1e6:.1f}M device={name} dtype={args.dtype} "
        f"prompt_len={args.prompt_len} new_tokens={args.new_tokens} torch={torch.__version__}",
        flush=True,
    )

    results = []
    for batch in batch_sizes:
        prompts = torch.randint(config.vocab_size, (batch, args.prompt_len), device=device)
        eager_tokens = None
        for mode in modes:
            seconds, tokens = run_mode(model, prompts, args.new_tokens, mode, args.repeats)
            eager_tokens = tokens if mode == "eager" else eager_tokens
            row = {
                "batch": batch, "mode": mode, "seconds": seconds, "tokens_per_second": batch * args.new_tokens / seconds,
                "same_tokens_as_eager": bool(torch.equal(tokens, eager_tokens)),
            }  # fmt: skip
            results.append(row)
            print(f"  batch {batch:4d} {mode:9s} {seconds:8.3f}s {row['tokens_per_second']:10.1f} tok/s", flush=True)

    eager = {r["batch"]: r["tokens_per_second"] for r in results if r["mode"] == "eager"}
    print()
    print("| batch | mode | tok/s | vs eager | seconds | same tokens as eager |")
    print("|------:|:-----|------:|---------:|--------:|:--------------------:|")
    for r in results:
        ratio = r["tokens_per_second"] / eager[r["batch"]]
        r["speedup_vs_eager"] = ratio
        print(
            f"| {r['batch']} | {r['mode']} | {r['tokens_per_second']:.1f} | {ratio:.2f}x | {r['seconds']:.3f} | "
            f"{'yes' if r['same_tokens_as_eager'] else 'no'} |"
        )
    if args.json:
        payload = {
            "preset": args.preset, "params": model.num_params(), "device": name, "dtype": args.dtype,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "torch": torch.__version__, "results": results,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
