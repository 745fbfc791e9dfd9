"""Decode throughput: eager KV cache vs static KV cache vs static + compiled decode step (and recomputation); and,
with ``--checkpoint``, sampled chat answers of a real model against transformers' ``generate``.

    python -m benchmarks.bench_generation --preset tiny                     # CPU, batch 1 and 8
    python -m benchmarks.bench_generation --device cuda --dtype bfloat16 --preset llama3.2-1b --batch-sizes 1,64 --json gen.json
    python -m benchmarks.bench_generation --checkpoint runs/smollm2-135m-instruct --batch-sizes 1,16,64 --new-tokens 32

``--checkpoint`` (a model folder Lantern wrote, which transformers loads as it is): the same left-padded chat prompts
(the held-out arithmetic questions of ``grpo_vs_trl.py``, in the model's own template), sampled at temperature 1 with the model's stop tokens, so rows end
at the lengths the model gives them (the stop distribution of an RL rollout); Lantern (``decode=auto``; stopped rows
leave the batch), Lantern with every row kept to the end (``COMPACT_WHEN_STOPPED`` 0: the difference is what leaving
saves) and transformers (``do_sample=True``, ``top_k=0``, the same stop ids), interleaved, --repeats times, median.
tok/s counts real new tokens (up to each row's stop token); each side draws its own samples, so the lengths are the
same distribution, not the same numbers: the table shows both.

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


def sampled_vs_transformers(args: argparse.Namespace) -> list[dict]:
    """Sampled chat answers of ``args.checkpoint``: Lantern (rows leaving the batch, and all kept) vs transformers."""
    import statistics
    import tempfile

    import transformers

    import models.generation as generation
    from data.demo.arithmetic import write_arithmetic_dataset
    from data.tokenizer.base import load_tokenizer
    from models.formats.checkpoint import load_checkpoint

    ours = load_checkpoint(args.checkpoint, dtype=torch.float32).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(args.checkpoint)
    stops, pad = sorted(tokenizer.stop_ids), tokenizer.pad_id
    seeds = iter(range(args.seed, 10**9))  # a fresh seed each run: each run samples anew
    with tempfile.TemporaryDirectory() as folder:  # the held-out questions of the GRPO benchmark (grpo_vs_trl.py)
        write_arithmetic_dataset(folder, tasks=["add", "multiply"], n_train=800, n_val=600, n_pairs=60, seed=0)
        records = [json.loads(line) for line in Path(folder, "prompts.jsonl").read_text().splitlines()]
    prompts_all = [tokenizer.encode_chat_prompt(record["messages"]) for record in records]
    print(f"checkpoint={args.checkpoint} threads={torch.get_num_threads()} new_tokens={args.new_tokens}", flush=True)

    results = []
    for batch in parse_batch_sizes(args.batch_sizes):
        prompts = prompts_all[:batch]
        ids, real = generation.left_pad(prompts, pad)

        def lantern(compact: int, prompts=prompts) -> list[int]:
            generation.COMPACT_WHEN_STOPPED = compact
            out = generation.generate(
                ours, prompts, max_new_tokens=args.new_tokens, temperature=1.0, stop_ids=stops, pad_id=pad,
                generator=torch.Generator().manual_seed(next(seeds)),
            )  # fmt: skip
            return out.lengths.tolist()

        def hf(ids=ids, real=real) -> list[int]:
            torch.manual_seed(next(seeds))
            with torch.inference_mode():
                out = theirs.generate(
                    input_ids=ids, attention_mask=real.long(), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    max_new_tokens=args.new_tokens, eos_token_id=stops, pad_token_id=pad,
                )[:, ids.shape[1] :]  # fmt: skip
            ended = torch.isin(out, torch.tensor(stops))
            first_stop = torch.where(ended.any(1), ended.float().argmax(1) + 1, out.shape[1])
            return first_stop.tolist()

        contenders = {
            "lantern": lambda: lantern(generation.COMPACT_DEFAULT),
            "lantern, rows kept": lambda: lantern(0),
            "transformers": hf,
        }
        for run in contenders.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in contenders}
        lengths: dict[str, list[int]] = {name: [] for name in contenders}
        for repeat in range(args.repeats):
            for name, run in list(contenders.items())[:: 1 if repeat % 2 == 0 else -1]:
                start = time.perf_counter()
                lengths[name] += run()
                times[name].append(time.perf_counter() - start)
        generation.COMPACT_WHEN_STOPPED = generation.COMPACT_DEFAULT
        for name in contenders:
            per_run = sum(lengths[name]) / args.repeats
            row = {
                "batch": batch, "contender": name, "median_s": statistics.median(times[name]),
                "tokens_per_second": per_run / statistics.median(times[name]),
                "mean_length": statistics.mean(lengths[name]),
                "ended_fraction": sum(n < args.new_tokens for n in lengths[name]) / len(lengths[name]),
            }  # fmt: skip
            results.append(row)
    lantern_rate = {(r["batch"]): r["tokens_per_second"] for r in results if r["contender"] == "lantern"}
    print(
        "\n| batch | contender | real tok/s | Lantern vs it | median s | mean length | rows ending before the limit |"
    )
    print("|------:|:----------|-----------:|--------------:|---------:|------------:|-----------------------------:|")
    for r in results:
        r["lantern_vs_it"] = lantern_rate[r["batch"]] / r["tokens_per_second"]
        print(
            f"| {r['batch']} | {r['contender']} | {r['tokens_per_second']:.1f} | {r['lantern_vs_it']:.2f}x | "
            f"{r['median_s']:.3f} | {r['mean_length']:.1f} | {r['ended_fraction']:.0%} |"
        )
    return results


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
    parser.add_argument(
        "--checkpoint", default=None, help="a model folder: sampled chat answers against transformers (see above)"
    )
    args = parser.parse_args()
    if args.checkpoint:
        torch.set_num_threads(args.threads)
        results = sampled_vs_transformers(args)
        if args.json:
            payload = {"checkpoint": args.checkpoint, "new_tokens": args.new_tokens, "repeats": args.repeats,
                       "threads": args.threads, "torch": torch.__version__, "results": results}  # fmt: skip
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
        return

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
