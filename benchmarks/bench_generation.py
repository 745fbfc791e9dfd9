"""Decode throughput: KV-cache generation vs recomputing the full sequence every step.

    python benchmarks/bench_generation.py                       # small preset, 256 new tokens, batch 1 and 8
    python benchmarks/bench_generation.py --preset tiny --new-tokens 64 --batch 1 4 16

Greedy decoding of a randomly initialised model on random prompts (speed does not depend on the weights),
no stop ids, so every row produces exactly --new-tokens tokens. Timings include the prefill. fp32 on CPU by
default; tokens/s counts generated tokens over all rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.generation import generate  # noqa: E402
from models.model import ModelConfig, Transformer  # noqa: E402


def time_generate(model: Transformer, prompts: list[list[int]], new_tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=new_tokens, temperature=0, use_cache=use_cache)
    elapsed = time.perf_counter() - start
    assert out.tokens.shape == (len(prompts), new_tokens)
    return elapsed, out.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="model preset in configs/model (default: small)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = ModelConfig.from_preset(args.preset)
    model = Transformer(config).to(args.device).eval()
    print(
        f"preset={args.preset} params={model.num_params() / 1e6:.1f}M device={args.device} fp32 "
        f"threads={torch.get_num_threads()} prompt_len={args.prompt_len} new_tokens={args.new_tokens}"
    )
    # Warm-up: first calls pay for allocator growth and kernel selection.
    warm_prompts = torch.randint(config.vocab_size, (1, args.prompt_len)).tolist()
    generate(model, warm_prompts, max_new_tokens=4, temperature=0)
    generate(model, warm_prompts, max_new_tokens=4, temperature=0, use_cache=False)

    rows = []
    for batch in args.batch:
        prompts = torch.randint(config.vocab_size, (batch, args.prompt_len)).tolist()
        cached_s, cached_tokens = time_generate(model, prompts, args.new_tokens, use_cache=True)
        recompute_s, recompute_tokens = time_generate(model, prompts, args.new_tokens, use_cache=False)
        generated = batch * args.new_tokens
        same = torch.equal(cached_tokens, recompute_tokens)
        rows.append((batch, generated / cached_s, generated / recompute_s, recompute_s / cached_s, cached_s, recompute_s, same))
        print(f"  batch {batch}: cache {cached_s:.2f}s, recompute {recompute_s:.2f}s", flush=True)

    print()
    print("| batch | KV cache tok/s | recompute tok/s | speed-up | cache s | recompute s | same tokens |")
    print("|------:|---------------:|----------------:|---------:|--------:|------------:|:-----------:|")
    for batch, cached_tps, recompute_tps, ratio, cached_s, recompute_s, same in rows:
        print(
            f"| {batch:5d} | {cached_tps:14.1f} | {recompute_tps:15.1f} | {ratio:7.1f}x | {cached_s:7.2f} | "
            f"{recompute_s:11.2f} | {'yes' if same else 'no':^11} |"
        )


if __name__ == "__main__":
    main()
