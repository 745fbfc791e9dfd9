"""PPO rollout cost: where a PPO step's time goes, and what the KV cache, batching and FSDP2 weight gathering buy.

    python -m benchmarks.bench_ppo                          # tiny preset: PPO run + generation + FSDP2 (~2-4 min on 2 CPU cores)
    python -m benchmarks.bench_ppo --preset small --rollouts 3
    python -m benchmarks.bench_ppo --skip-ppo               # only the 2-process FSDP2 generation part
    python -m benchmarks.bench_ppo --skip-fsdp --threads 1

Part 1 (one process): a randomly initialised model of ``--preset`` is saved as the SFT policy and (through
``ScalarModel.from_backbone``) as the reward model, demo prompts are written with ``write_demo_dataset``, and
``run_ppo`` does ``--rollouts`` PPO steps of ``--rollout-batch`` prompts x ``--response-tokens`` new tokens
(sampling at temperature 1, CSV logger). The ppo/* metrics it logs give, per rollout: generation tokens/s and
the split of the PPO step between generation, scoring (policy/reference log-probs, critic values, reward)
and PPO training epochs. The first rollout carries one-off warm-up costs; the summary averages the others.
Then the same prompts are generated greedily, without stop ids (every row produces exactly
``--response-tokens``), with the KV cache at batch ``--rollout-batch`` and at batch 1, and with
``use_cache=False`` (the whole sequence recomputed every step) at batch ``--rollout-batch``.

Part 2 (2 gloo processes on CPU, OMP_NUM_THREADS=1): the model is sharded with FSDP2 (``apply_fsdp``, with
``hidden_states`` registered as configure_parallelism does), and each rank generates ``--fsdp-new-tokens``
greedy tokens for its own ``--fsdp-batch`` prompts (a) plainly: every forward all-gathers the blocks that
reshard after forward (all but the last, see apply_fsdp), i.e. one round of all-gathers per generated
token; (b) inside ``unsharded_for_generation``: one all-gather per FSDP module for the whole generation. Each
generation starts from fully sharded weights (as after an optimiser step). All-gathers are counted by wrapping
the torch.distributed functions FSDP2 calls (torch 2.13: ``dist.all_gather_single`` from
``_fsdp_collectives.DefaultAllGather``; the older ``all_gather_into_tensor`` / ``_all_gather_base`` /
``all_gather`` are wrapped too). Times are the slowest rank's, best of ``--repeats``; (b) includes the gather
and the reshard. Tokens are checked against an unsharded copy of the model in each process.

Timings are wall clock on a possibly shared machine: compare ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from alignment.schemas.rl import PPOConfig
from alignment.stages.ppo import run_ppo
from data.demo.tasks import write_demo_dataset
from data.records.prompts import PromptDataModule
from data.tokenizer.tokenizer import Tokenizer
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.generation import generate
from models.heads import ScalarModel, save_scalar_model
from models.model import ModelConfig, Transformer
from trainer.config import load_config
from trainer.parallel import apply_fsdp, unsharded_for_generation
from trainer.plots import read_csv_rows

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- part 1: one process


def write_inputs(preset: str, root: Path, seed: int) -> dict:
    """Random-init policy + reward model folders and demo prompts (prompts.jsonl = the val records), as the earlier stages would leave them."""
    tokenizer = Tokenizer.load("default")
    torch.manual_seed(seed)
    policy = Transformer(ModelConfig.from_preset(preset))
    policy_dir = save_checkpoint(policy, root / "sft", tokenizer_path=tokenizer.path)
    reward_dir = save_scalar_model(
        ScalarModel.from_backbone(policy),
        root / "rm",
        tokenizer_path=tokenizer.path,
        metadata={"reward_mean": 0.0, "reward_std": 1.0},
    )
    demo = write_demo_dataset(root / "demo", n_train=8, n_val=96, n_pairs=4, seed=seed)
    return {"policy": policy_dir, "reward": reward_dir, "prompts": demo["prompts"], "params": policy.num_params()}


def ppo_overrides(args, inputs: dict, out_dir: Path) -> list[str]:
    return [
        f"init.policy={inputs['policy']}", f"init.reward_model={inputs['reward']}", f"data.train=[{inputs['prompts']}]",
        f"run.out_dir={out_dir}", "run.name=bench", "logger.kind=csv", "trainer.accelerator=cpu",
        f"trainer.max_steps={args.rollouts}", f"ppo.rollout_batch_size={args.rollout_batch}",
        f"ppo.minibatch_size={args.minibatch}", f"ppo.micro_batch_size={args.micro_batch}", f"ppo.epochs={args.epochs}",
        f"ppo.response_max_tokens={args.response_tokens}", f"run.seed={args.seed}",
        # no checkpoints or evaluations inside the run (the step-0 and final evaluations are outside the timed step)
        "checkpoint.every_n_steps=1000000", "eval.every_n_rollouts=1000000", "eval.generations=2",
    ]  # fmt: skip


def read_ppo_metrics(run_dir: Path) -> list[dict[str, float]]:
    """One dict of ppo/* values per rollout, from the CSV logger's metrics.csv."""
    return [
        {k: float(v) for k, v in row.items() if k.startswith("ppo/") and v not in ("", None)}
        for row in read_csv_rows(run_dir / "csv" / "metrics.csv")
        if row.get("ppo/rollout_time") not in (None, "")
    ]


def best_time(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def generation_comparison(args, inputs: dict, config) -> list[tuple]:
    """Greedy generation on the run's first prompts: KV cache at batch B and 1, recompute at batch B."""
    datamodule = PromptDataModule(config.data, batch_size=args.rollout_batch)
    datamodule.setup("fit")
    prompts = [p["prompt_ids"] for p in datamodule.train_prompts[: args.rollout_batch]]
    model = load_checkpoint(inputs["policy"], dtype=torch.float32).eval()
    n = args.response_tokens
    gen = lambda batch, use_cache: generate(model, batch, max_new_tokens=n, temperature=0, use_cache=use_cache).tokens  # noqa: E731
    gen(prompts[:2], True), gen(prompts[:2], False)  # warm-up
    cached_s, cached = best_time(lambda: gen(prompts, True), args.repeats)
    single_s, single = best_time(lambda: torch.cat([gen([p], True) for p in prompts]), args.repeats)
    recompute_s, recompute = best_time(lambda: gen(prompts, False), 1)  # the slow one: once
    tokens = len(prompts) * n
    same_rows = lambda other: int((other == cached).all(dim=1).sum())  # noqa: E731
    lengths = [len(p) for p in prompts]
    print(
        f"  generation prompts: {len(prompts)}, lengths {min(lengths)}-{max(lengths)} (mean {sum(lengths) / len(lengths):.0f}), {n} new tokens each",
        flush=True,
    )
    return [
        (
            f"KV cache, batch {len(prompts)}",
            cached_s,
            tokens / cached_s,
            1.0,
            f"{len(prompts)}/{len(prompts)} (reference)",
        ),
        (
            "KV cache, batch 1 (one prompt at a time)",
            single_s,
            tokens / single_s,
            cached_s / single_s,
            f"{same_rows(single)}/{len(prompts)}",
        ),
        (
            f"no cache (use_cache=False), batch {len(prompts)}",
            recompute_s,
            tokens / recompute_s,
            cached_s / recompute_s,
            f"{same_rows(recompute)}/{len(prompts)}",
        ),
    ]


def part_one(args) -> None:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_ppo_") as tmp:
        root = Path(tmp)
        inputs = write_inputs(args.preset, root, args.seed)
        config = load_config(PPOConfig, ROOT / "configs/ppo/tiny.yaml", ppo_overrides(args, inputs, root / "runs"))
        print(
            f"\n## Part 1: PPO in one process — preset={args.preset} ({inputs['params'] / 1e6:.1f}M params), fp32, "
            f"threads={torch.get_num_threads()}, {args.rollouts} rollouts x {args.rollout_batch} prompts x "
            f"{args.response_tokens} new tokens, {args.epochs} PPO epochs, minibatch {args.minibatch}, micro-batch {args.micro_batch}",
            flush=True,
        )
        start = time.perf_counter()
        run_dir = run_ppo(config)
        run_s = time.perf_counter() - start
        rows = read_ppo_metrics(run_dir)
        print(f"  run_ppo: {run_s:.1f}s in all (model loading, step-0 and final evaluations included)", flush=True)
        comparison = generation_comparison(args, inputs, config)

    print("\n### PPO step breakdown (from the logged ppo/* metrics)\n")
    print(
        "| rollout | gen tok/s | resp. len | generation s | scoring s | training s | step s | generation | scoring | training |"
    )
    print(
        "|--------:|----------:|----------:|-------------:|----------:|-----------:|-------:|-----------:|--------:|---------:|"
    )

    def line(label: str, m: dict[str, float]) -> None:
        gen, roll, train = m["ppo/generation_time"], m["ppo/rollout_time"], m["ppo/train_time"]
        step = roll + train
        print(
            f"| {label:>7} | {m['ppo/rollout_tokens_per_second']:9.1f} | {m['ppo/response_length']:9.1f} | {gen:12.3f} | "
            f"{roll - gen:9.3f} | {train:10.3f} | {step:6.3f} | {gen / step:10.1%} | {(roll - gen) / step:7.1%} | {train / step:8.1%} |"
        )

    for index, m in enumerate(rows, 1):
        line(str(index), m)
    steady = rows[1:] if len(rows) > 1 else rows
    mean = {k: sum(r[k] for r in steady) / len(steady) for k in steady[0]}
    line(f"mean {2 if len(rows) > 1 else 1}-{len(rows)}", mean)
    print(f"\n(logged ppo/generation_share of the last rollout: {rows[-1]['ppo/generation_share']:.1%})")

    print(
        f"\n### Generation alone, greedy, same prompts ({args.response_tokens} new tokens per row, prefill included, best of {args.repeats})\n"
    )
    print("| mode | seconds | tokens/s | speed vs KV cache batch | rows identical to KV cache batch |")
    print("|:-----|--------:|---------:|------------------------:|:--------------------------------:|")
    for label, seconds, tps, relative, same in comparison:
        print(f"| {label} | {seconds:.3f} | {tps:.1f} | {relative:.2f}x | {same} |")
    print(f"\nKV cache vs recompute at batch {args.rollout_batch}: {comparison[2][1] / comparison[0][1]:.1f}x faster; "
          f"batch {args.rollout_batch} vs batch 1: {comparison[1][1] / comparison[0][1]:.1f}x faster (same tokens).")  # fmt: skip


# ---------------------------------------------------------------- part 2: FSDP2 generation, 2 gloo processes

ALL_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")
COUNTS: dict[str, int] = {}
_DEPTH = [0]


def install_all_gather_counters() -> None:
    """Count top-level all-gather calls (one library function may call another: counted once)."""
    for name in ALL_GATHER_NAMES:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_counted", False):
            continue

        def wrapper(*a, _original=original, _name=name, **kw):
            if _DEPTH[0] == 0:
                COUNTS[_name] = COUNTS.get(_name, 0) + 1
            _DEPTH[0] += 1
            try:
                return _original(*a, **kw)
            finally:
                _DEPTH[0] -= 1

        wrapper._counted = True
        for module in (dist, c10d):  # FSDP2 calls dist.<name>: looked up at call time
            if hasattr(module, name):
                setattr(module, name, wrapper)


def reshard_all(model) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_worker(rank: int, world: int, port: int, options: dict, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(options["seed"])
        config = ModelConfig.from_preset(options["preset"])
        model = Transformer(config)
        reference = copy.deepcopy(model).eval()  # unsharded copy: the tokens every variant must reproduce
        # as configure_parallelism does: generate() runs the model through hidden_states() + logits()
        apply_fsdp(model, init_device_mesh("cpu", (world,)), extra_forward_methods=("token_losses", "hidden_states"))
        model.eval()
        sampler = torch.Generator().manual_seed(options["seed"] + 1 + rank)  # each rank its own prompts
        lengths = torch.randint(16, 49, (options["batch"],), generator=sampler).tolist()
        prompts = [torch.randint(config.vocab_size, (n,), generator=sampler).tolist() for n in lengths]
        n = options["new_tokens"]
        with torch.no_grad():  # a first forward, as training would do, runs FSDP's lazy initialisation
            model(torch.tensor([prompts[0]]))
        install_all_gather_counters()

        def plain():
            return generate(model, prompts, max_new_tokens=n, temperature=0).tokens

        def gathered():
            with unsharded_for_generation(model):
                return generate(model, prompts, max_new_tokens=n, temperature=0).tokens

        def measure(fn):
            reshard_all(model)  # start from sharded weights, as after an optimiser step
            dist.barrier()
            COUNTS.clear()
            start = time.perf_counter()
            tokens = fn()
            elapsed = time.perf_counter() - start
            counts = dict(COUNTS)
            dist.barrier()
            return elapsed, tokens, counts

        for fn in (plain, gathered):  # warm-up
            measure(fn)
        results = {"plain": [], "gathered": []}
        for _ in range(options["repeats"]):
            for name, fn in (("plain", plain), ("gathered", gathered)):
                results[name].append(measure(fn))
        unsharded_s, expected = best_time(
            lambda: generate(reference, prompts, max_new_tokens=n, temperature=0).tokens, options["repeats"]
        )
        mine = {
            "rank": rank,
            "unsharded_s": unsharded_s,
            **{f"{name}_s": min(r[0] for r in runs) for name, runs in results.items()},
            **{f"{name}_counts": [r[2] for r in runs] for name, runs in results.items()},
            **{f"{name}_same": all(torch.equal(r[1], expected) for r in runs) for name, runs in results.items()},
            "tokens_generated": int(expected.numel()),
            "prompt_lengths": lengths,
        }
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            fsdp_modules = sum(1 for m in model.modules() if isinstance(m, FSDPModule))
            Path(result_file).write_text(
                json.dumps({"ranks": everyone, "fsdp_modules": fsdp_modules, "n_layers": config.n_layers})
            )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_two(args) -> None:
    world = 2
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned processes
    options = {
        "preset": args.fsdp_preset or args.preset,
        "batch": args.fsdp_batch,
        "new_tokens": args.fsdp_new_tokens,
        "repeats": args.repeats,
        "seed": args.seed,
    }
    print(
        f"\n## Part 2: FSDP2 generation — {world} gloo processes on CPU (1 thread each), preset={options['preset']}, "
        f"{options['batch']} prompts per rank (16-48 tokens), {options['new_tokens']} greedy new tokens, best of {options['repeats']}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench_ppo_fsdp_") as tmp:
        result_file = str(Path(tmp) / "result.json")
        start = time.perf_counter()
        mp.spawn(fsdp_worker, args=(world, free_port(), options, result_file), nprocs=world, join=True)
        print(f"  spawned run: {time.perf_counter() - start:.1f}s", flush=True)
        result = json.loads(Path(result_file).read_text())

    ranks, n, layers = result["ranks"], args.fsdp_new_tokens, result["n_layers"]
    modules = result["fsdp_modules"]

    def counts(name: str) -> tuple[int, str]:
        per_run = [sum(c.values()) for r in ranks for c in r[f"{name}_counts"]]
        functions = sorted({f for r in ranks for c in r[f"{name}_counts"] for f in c})
        total = per_run[0] if len(set(per_run)) == 1 else f"{min(per_run)}-{max(per_run)}"
        return total, ", ".join(functions) or "-"

    seconds = {name: max(r[f"{name}_s"] for r in ranks) for name in ("plain", "gathered", "unsharded")}
    tokens = ranks[0]["tokens_generated"]
    print(
        f"\nFSDP modules: {modules} ({layers} blocks + root); forwards per generation: {n} (prefill + {n - 1} decode steps; the last token is not fed back)\n"
    )
    print(
        "| generation | all-gathers per generation (per rank) | function called | seconds (slowest rank) | tokens/s per rank | tokens = unsharded model |"
    )
    print(
        "|:-----------|--------------------------------------:|:----------------|-----------------------:|------------------:|:------------------------:|"
    )
    for name, label in (
        ("plain", "(a) plain FSDP2 (per-forward all-gathers)"),
        ("gathered", "(b) inside unsharded_for_generation"),
    ):
        total, functions = counts(name)
        same = "yes" if all(r[f"{name}_same"] for r in ranks) else "NO"
        print(f"| {label} | {total} | {functions} | {seconds[name]:.3f} | {tokens / seconds[name]:.1f} | {same} |")
    print(
        f"| unsharded model, no FSDP (reference) | 0 | - | {seconds['unsharded']:.3f} | {tokens / seconds['unsharded']:.1f} | (reference) |"
    )
    plain_total, gathered_total = counts("plain")[0], counts("gathered")[0]
    print(
        f"\nExpected: (a) (n_layers - 1) x {n} + 2 = {(layers - 1) * n + 2} (blocks 0..{layers - 2} reshard after every forward; "
        f"the last block and the root keep their weights after the first gather, see apply_fsdp / FSDP2's root default), "
        f"(b) {modules} (one per FSDP module)."
    )
    if isinstance(plain_total, int) and isinstance(gathered_total, int) and gathered_total:
        print(f"All-gathers: {plain_total / gathered_total:.1f}x fewer with unsharded_for_generation.")
    print(
        f"Speed-up of (b) over (a): {seconds['plain'] / seconds['gathered']:.2f}x (overhead of (b) over the unsharded model: {seconds['gathered'] / seconds['unsharded']:.2f}x)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset in configs/model (default: tiny)")
    parser.add_argument("--rollouts", type=int, default=4, help="PPO steps (rollouts) in part 1")
    parser.add_argument("--rollout-batch", type=int, default=16)
    parser.add_argument("--minibatch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--response-tokens", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in part 1 (1: on a shared 2-core machine 2 threads were 3x slower)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timings: best of this many")
    parser.add_argument("--fsdp-preset", default=None, help="model preset of part 2 (default: --preset)")
    parser.add_argument("--fsdp-batch", type=int, default=8, help="prompts per rank in part 2")
    parser.add_argument("--fsdp-new-tokens", type=int, default=32)
    parser.add_argument("--skip-ppo", action="store_true")
    parser.add_argument("--skip-fsdp", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rollout_batch % args.minibatch or args.minibatch % args.micro_batch:
        parser.error("--rollout-batch must be a multiple of --minibatch, and that of --micro-batch")
    if not args.skip_ppo:
        part_one(args)
    if not args.skip_fsdp:
        part_two(args)


if __name__ == "__main__":
    main()
