"""Pretraining throughput, MFU and peak memory: Lantern's real Lightning path against a plain PyTorch loop over
the same model and against Hugging Face ``transformers``' LlamaForCausalLM of the same shape, in ONE run.

Contenders (``--contenders``; each trains ``--warmup`` untimed then ``--steps`` timed optimizer steps on the same
packed batches, same precision, same ``trainer.compile`` setting, same AdamW):

* **lightning** -- ``Trainer.fit`` built exactly as ``run_pretrain`` builds it (PretrainModule, the pretrain
  datamodule, ``make_trainer``, DataProgress and Throughput callbacks), without validation, checkpoints or export;
* **plain** -- a hand-written loop over Lantern's ``Transformer``: ``token_losses`` (document masking, chunked
  loss), backward, clipping, ``build_optimizer``'s AdamW; blocks compiled as ``trainer.parallel`` compiles them;
* **hf** -- ``LlamaForCausalLM`` randomly initialised from the ``LlamaConfig`` Lantern exports for this shape (no
  download), SDPA attention, plain causal (it has no document masking), the whole model ``torch.compile``d.

Measured per contender: tokens/s (mean over the timed steps; also at the median and fastest step), MFU = tokens/s x
``ModelConfig.flops_per_token(seq_len)`` (6N + 12·L·d·T, the same count for all, never the recomputation of
activation checkpointing) / peak, peak memory (``torch.cuda.max_memory_allocated``; not measured on CPU), the
data-loader wait as a share of the step, and the ratios to ``hf``. The peak is ``--peak-tflops`` (default on CUDA:
989, H100 dense bf16); on CPU without it, the best square-matmul FLOP/s of the training dtype measured in this run
before, during (every ``--peak-every`` steps, excluded from the step time) and after each contender.

``--fsdp-ac``: the Lightning path alone under FSDP2 on one device with full activation checkpointing (the 3B
single-GPU mode); it also prints the hardware FLOPs utilisation that counts the recomputed forward passes.

CPU (the ``shakespeare`` preset: ``small`` model, seq 256 x 8, fp32 and bf16):

    python -m benchmarks.bench_pretrain [--steps 20 --warmup 3 --precision 32-true bf16-true --threads 2]

GPU (Llama 3.2 1B, seq 2048 x 4, bf16, compiled; then 3B with FSDP2 + activation checkpointing):

    python -m benchmarks.bench_pretrain --device cuda --config configs/pretrain/llama3.2-1b-1gpu.yaml --json 1b.json
    python -m benchmarks.bench_pretrain --device cuda --config configs/pretrain/llama3.2-1b-1gpu.yaml \\
        --preset llama3.2-3b --fsdp-ac --json 3b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch

from alignment.schemas.pretrain import PretrainConfig
from alignment.shared.plan_knobs import device_target
from alignment.shared.stage_plan import Models
from alignment.stages.pretrain import PretrainModule, pretrain_datamodule
from alignment.stages.registry import stage_named
from data.pretrain.prepare import prepare
from models.formats.hf_format import config_to_hf
from models.model import Transformer
from trainer.build import make_trainer, prepare_trainer, run_directory
from trainer.callbacks import DataProgress, Throughput, measure_matmul_flops
from trainer.config import load_config
from trainer.optim import build_optimizer
from trainer.parallel import apply_activation_checkpointing, apply_compile, grad_norm_and_clip

ROOT = Path(__file__).resolve().parents[1]  # the checkout: default config and relative data sources
CONTENDERS = ("lightning", "plain", "hf")
H100_BF16_TFLOPS = 989.0


class StepTimer(L.Callback):
    """Wall-clock marks at the start and end of every optimizer step (the end waits for the GPU). Lightning calls
    it as its last callback; the plain loops call ``mark_start`` / ``mark_end`` themselves.

    Every ``peak_every`` steps it runs ``measure`` (the CPU matmul peak) right after the end mark, so peak and
    training share the machine's conditions; that time is excluded from the step it follows."""

    def __init__(self, measure: Callable[[], float] | None, peak_every: int, cuda: bool) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.excluded: dict[int, float] = {}
        self.measure, self.peak_every, self.cuda = measure, peak_every, cuda
        self.peaks: list[float] = []

    def mark_start(self) -> None:
        self.starts.append(time.perf_counter())

    def mark_end(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        self.ends.append(end)
        if self.measure is not None and self.peak_every and len(self.ends) % self.peak_every == 0:
            self.peaks.append(self.measure())
            self.excluded[len(self.ends) - 1] = time.perf_counter() - end

    def on_train_batch_start(self, *args: Any) -> None:
        self.mark_start()

    def on_train_batch_end(self, *args: Any) -> None:
        self.mark_end()

    def steps(self, first: int) -> list[tuple[float, float]]:
        """(seconds, seconds waiting before the step started) for every step from ``first`` on."""
        out = []
        for i in range(first, len(self.ends)):
            previous_end = self.ends[i - 1] + self.excluded.get(i - 1, 0.0)
            out.append((self.ends[i] - previous_end, self.starts[i] - previous_end))
        return out


def build_config(args: argparse.Namespace, precision: str | None, out_dir: Path, name: str) -> PretrainConfig:
    """The pretraining config under test: --config, then the benchmark's settings, then --override (which win)."""
    overrides = [f"model={args.preset}"] if args.preset else []
    overrides += [f"loader.seq_len={args.seq_len}"] if args.seq_len else []
    overrides += [f"loader.micro_batch_size={args.micro_batch}"] if args.micro_batch else []
    overrides += [f"trainer.precision={precision}"] if precision else []
    if args.fsdp_ac:
        overrides += ["trainer.strategy=fsdp", "trainer.activation_checkpointing=full"]
    else:  # one process, weights built on the host (meta init needs FSDP)
        overrides += ["trainer.strategy=single", "trainer.init_device=cpu"]
    overrides += [
        f"data.out_dir={args.data_dir}",
        f"run.out_dir={out_dir}",
        f"run.name=bench-{name}",
        f"loader.num_workers={args.num_workers}",
        f"trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}",
        "trainer.devices=1",
        "trainer.num_nodes=1",
        "trainer.accumulate_grad_batches=1",
        f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.log_every_n_steps=1",
        "logger.kind=none",
        *args.override,
    ]
    config = load_config(PretrainConfig, args.config, overrides)
    if config.loader.seq_len > config.model.max_seq_len:
        raise SystemExit(
            f"loader.seq_len ({config.loader.seq_len}) exceeds model.max_seq_len ({config.model.max_seq_len})"
        )
    # `auto` precision and compile resolved, matmul precision set: for the contenders outside Lightning too
    prepare_trainer(config.trainer)
    return config


def prepare_data(args: argparse.Namespace) -> None:
    """Tokenize ``--data-config``'s corpus (default: the bundled one) into ``args.data_dir`` (nothing to do when it
    is already there). Speed does not depend on which token ids a batch holds, only on shapes and document bounds."""
    config = load_config(PretrainConfig, args.data_config, [f"data.out_dir={args.data_dir}"])
    config.data.source = [s if Path(s).is_absolute() else str(ROOT / s) for s in config.data.source]
    prepare(config.data)


def batch_stream(config: PretrainConfig, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The training batches the Lightning path would see, endlessly, moved to ``device``."""
    datamodule = pretrain_datamodule(config)
    datamodule.setup("fit")
    while True:
        for batch in datamodule.train_dataloader():
            datamodule.mark_consumed(1)  # the next pass continues the stream, as under DataProgress
            yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def autocast(config: PretrainConfig, device: torch.device):
    """bf16-mixed: fp32 weights, bf16 compute (Lightning's autocast); the other precisions need none."""
    if config.trainer.precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def optimizer_for(model: torch.nn.Module, config: PretrainConfig):
    optim = config.optim
    return build_optimizer(
        model, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
        eps=optim.eps, warmup_steps=optim.warmup_steps, max_steps=config.trainer.max_steps,
        decay_embeddings_and_norms=optim.decay_embeddings_and_norms,
    )  # fmt: skip


def plain_loop(
    model: torch.nn.Module, loss_fn, config: PretrainConfig, args: argparse.Namespace, timer: StepTimer
) -> float:
    """The training step with nothing around it: forward + loss, backward, clip, AdamW, schedule. Returns the
    last loss (synchronised once, at the end, so the loop never waits for the device)."""
    device = torch.device(args.device)
    if config.trainer.precision == "bf16-true":
        model.to(torch.bfloat16)
    model.to(device)
    optimizer, schedule = optimizer_for(model, config)
    batches = batch_stream(config, device)
    loss = torch.zeros(())
    for _ in range(args.warmup + args.steps):
        batch = next(batches)
        timer.mark_start()
        with autocast(config, device):
            loss = loss_fn(batch)
        loss.backward()
        grad_norm_and_clip(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        timer.mark_end()
    return float(loss.detach())


def run_lightning(config: PretrainConfig, args: argparse.Namespace, timer: StepTimer) -> float:
    tokens = config.loader.micro_batch_size * config.loader.seq_len
    # peak 1 FLOP/s: the "mfu" Throughput logs is unused here; the benchmark computes its own
    callbacks = [DataProgress(), Throughput(tokens, config.model.flops_per_token(config.loader.seq_len), 1.0), timer]
    trainer = make_trainer(config.trainer, run_dir=run_directory(config.run.out_dir, config.run.name),
                           callbacks=callbacks, logger=False, validate=False)  # fmt: skip
    trainer.fit(PretrainModule(config), datamodule=pretrain_datamodule(config))
    return float(trainer.callback_metrics["train/loss"])


def run_plain(config: PretrainConfig, args: argparse.Namespace, timer: StepTimer) -> float:
    torch.manual_seed(config.run.seed)
    model = Transformer(config.model)
    apply_activation_checkpointing(model, config.trainer.activation_checkpointing, config.trainer.ac_every)
    if config.trainer.compile:
        apply_compile(model)

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses = model.token_losses(batch["input_ids"], batch["targets"], document_ids=batch.get("document_ids"),
                                    z_loss=config.optim.z_loss, chunk_size=config.trainer.loss_chunk_size)  # fmt: skip
        return losses.sum() / (batch["targets"] != -100).sum()

    return plain_loop(model, loss_fn, config, args, timer)


def run_hf(config: PretrainConfig, args: argparse.Namespace, timer: StepTimer) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM  # the test extra: only this contender needs it

    if config.trainer.activation_checkpointing != "none":
        raise SystemExit("the hf contender runs without activation checkpointing; use --contenders lightning plain")
    hf = config_to_hf(config.model, torch.float32, None, None)
    for key in ("architectures", "model_type", "dtype", "torch_dtype"):
        hf.pop(key)
    hf["use_cache"] = False
    torch.manual_seed(config.run.seed)
    model = LlamaForCausalLM(LlamaConfig(**hf, attn_implementation="sdpa"))
    if model.num_parameters() != config.model.num_params():  # the same shape, or the comparison means nothing
        raise RuntimeError(f"hf model has {model.num_parameters()} parameters, Lantern's {config.model.num_params()}")
    forward = torch.compile(model) if config.trainer.compile else model

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # HF's own loss inside the compiled forward (fp32 logits, mean over labelled tokens); shift_labels: the
        # targets are already shifted (transformers >= 4.50; older versions would shift once more, same work)
        return forward(input_ids=batch["input_ids"], labels=batch["targets"], shift_labels=batch["targets"]).loss

    return plain_loop(model, loss_fn, config, args, timer)


def measure(name: str, config: PretrainConfig, args: argparse.Namespace) -> dict[str, Any]:
    """One contender's numbers; everything it allocated is released before the next one starts."""
    cuda = args.device == "cuda"
    dtype = torch.float32 if config.trainer.precision == "32-true" else torch.bfloat16
    cpu_peak = (
        None
        if args.peak_tflops
        else (lambda: measure_matmul_flops(torch.device("cpu"), dtype, args.peak_size, args.peak_seconds))
    )
    timer = StepTimer(cpu_peak, args.peak_every, cuda)
    if cpu_peak:
        timer.peaks.append(cpu_peak())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() / 2**30  # left by an earlier contender: should be ~0
    loss = {"lightning": run_lightning, "plain": run_plain, "hf": run_hf}[name](config, args, timer)
    if cpu_peak:
        timer.peaks.append(cpu_peak())
    if len(timer.ends) != args.warmup + args.steps:
        raise RuntimeError(f"{name}: expected {args.warmup + args.steps} steps, timed {len(timer.ends)}")
    steps = timer.steps(args.warmup)
    total = sum(seconds for seconds, _ in steps)
    times = [seconds for seconds, _ in steps]
    tokens = config.loader.micro_batch_size * config.loader.seq_len
    flops = config.model.flops_per_token(config.loader.seq_len)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else max(timer.peaks)
    result = {
        "contender": name,
        "precision": config.trainer.precision,
        "document_masking": config.loader.document_masking and name != "hf",
        "tokens_per_second": tokens * len(steps) / total,
        "tokens_per_second_median_step": tokens / statistics.median(times),
        "tokens_per_second_best_step": tokens / min(times),
        "step_ms": 1000 * total / len(steps),
        "step_ms_min_max": [1000 * min(times), 1000 * max(times)],
        "data_wait_share": sum(wait for _, wait in steps) / total,
        "peak_flops": peak,
        "peak_flops_samples": timer.peaks,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "memory_at_start_gib": held if cuda else None,
        "loss": loss,
    }
    result["mfu"] = result["tokens_per_second"] * flops / peak
    result["mfu_best_step"] = result["tokens_per_second_best_step"] * flops / peak
    if name == "lightning" and config.trainer.activation_checkpointing != "none":
        result["hfu_with_recomputation"] = result["tokens_per_second"] * (flops + recomputed_flops(config)) / peak
    if name == "lightning":  # what `lantern plan` predicted for this run, beside what it measured
        result["planned_peak_gib"] = planned_peak_gib(config)
    gc.collect()
    torch._dynamo.reset()  # the next contender compiles from scratch, as it would alone
    if cuda:
        torch.cuda.empty_cache()
    return result


def planned_peak_gib(config: PretrainConfig) -> float | None:
    """The plan's peak per GPU  for this config on this device, in GiB; None if the
    estimator fails (the benchmark goes on)."""
    try:
        plan = stage_named("pretrain").plan(config, Models(config.model), device_target(config.trainer))
    except Exception as error:  # an estimator bug must not cost the measurement
        logging.getLogger(__name__).warning("plan: no estimate (%s)", error)
        return None
    return plan.peak / 2**30


def recomputed_flops(config: PretrainConfig) -> float:
    """FLOPs per token that activation checkpointing adds: one more forward of each checkpointed block (2 x its
    matmul weights + attention's 4·d·T), which MFU does not count."""
    model, seq_len = config.model, config.loader.seq_len
    block = model.dim * model.head_dim * (2 * model.n_heads + 2 * model.n_kv_heads) + 3 * model.dim * model.hidden_dim
    every = 1 if config.trainer.activation_checkpointing == "full" else config.trainer.ac_every
    wrapped = len(range(0, model.n_layers, every))
    return wrapped * (2 * block + 4 * model.dim * seq_len)


def print_table(
    config: PretrainConfig, args: argparse.Namespace, results: list[dict[str, Any]], device_name: str
) -> None:
    model, seq_len = config.model, config.loader.seq_len
    print(f"\npretraining benchmark: {device_name}; torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    print(
        f"model: {model.num_params() / 1e6:.1f}M parameters ({model.dim}x{model.n_layers}), "
        f"{model.flops_per_token(seq_len) / 1e9:.3f} GFLOP/token at seq_len {seq_len}; micro-batch "
        f"{config.loader.micro_batch_size}; {args.steps} timed steps after {args.warmup}; strategy "
        f"{config.trainer.strategy}, compile={config.trainer.compile}, activation_checkpointing="
        f"{config.trainer.activation_checkpointing}, loss_chunk_size={config.trainer.loss_chunk_size}"
    )
    peak = (
        f"{args.peak_tflops:.0f} TFLOP/s given"
        if args.peak_tflops
        else "best matmul FLOP/s of the training dtype measured in this run"
    )
    print(f"peak: {peak}")
    header = f"{'contender':<10} {'precision':<10} {'doc mask':>8} {'tokens/s':>10} {'best':>10} {'step ms':>8} {'MFU':>6} {'MFU best':>8} {'vs hf':>6} {'peak GiB':>8} {'data wait':>9} {'loss':>7}"
    print(header + "\n" + "-" * len(header))
    for r in results:
        hf = next((h for h in results if h["contender"] == "hf" and h["precision"] == r["precision"]), None)
        r["vs_hf"] = r["tokens_per_second"] / hf["tokens_per_second"] if hf else None
        vs_hf = f"{r['vs_hf']:.2f}x" if r["vs_hf"] else "-"
        memory = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "n/a"
        print(
            f"{r['contender']:<10} {r['precision']:<10} {r['document_masking']!s:>8} {r['tokens_per_second']:>10.0f} "
            f"{r['tokens_per_second_best_step']:>10.0f} {r['step_ms']:>8.1f} {r['mfu']:>6.1%} {r['mfu_best_step']:>8.1%} "
            f"{vs_hf:>6} {memory:>8} "
            f"{r['data_wait_share']:>9.2%} {r['loss']:>7.3f}"
        )
        if r["mfu"] > 1:  # a measured CPU peak can be: a loaded machine, or a matmul unlike the model's
            print(
                f"{'':<10} MFU above 100%: the measured peak is below what training reached; pass --peak-tflops or a --peak-size like the model's matmuls"
            )
        if "hfu_with_recomputation" in r:
            print(
                f"{'':<10} hardware FLOPs utilisation counting the recomputed forwards: {r['hfu_with_recomputation']:.1%}"
            )
    print(
        "tokens/s: mean over the timed steps (best: the fastest step); MFU: model FLOPs (6N + 12·L·d·T per token, "
        "no recomputation) over the peak; vs hf: tokens/s over Hugging Face's at the same precision; peak GiB: "
        "torch.cuda.max_memory_allocated; data wait: share of step time between steps (DataLoader + transfer + loop)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default=str(ROOT / "configs" / "pretrain" / "shakespeare.yaml"), help="pretrain config under test"
    )
    parser.add_argument("--preset", help="model preset (default: the config's model)")
    parser.add_argument("--seq-len", type=int, help="default: the config's loader.seq_len")
    parser.add_argument("--micro-batch", type=int, help="default: the config's loader.micro_batch_size")
    parser.add_argument(
        "--precision",
        nargs="+",
        choices=["32-true", "bf16-true", "bf16-mixed"],
        help="default: 32-true and bf16-true on CPU, the config's trainer.precision on CUDA",
    )
    parser.add_argument(
        "--contenders", nargs="+", choices=CONTENDERS, help=f"default: {' '.join(CONTENDERS)}; lightning with --fsdp-ac"
    )
    parser.add_argument(
        "--fsdp-ac", action="store_true", help="FSDP2 on one device + full activation checkpointing (Lightning path)"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed optimizer steps first (compilation happens here)"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (loader.num_workers)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help=f"peak per device for MFU (default: {H100_BF16_TFLOPS:.0f} on CUDA, measured on CPU)",
    )
    parser.add_argument("--peak-size", type=int, default=2048, help="square matmul size of the measured CPU peak")
    parser.add_argument("--peak-seconds", type=float, default=0.5, help="seconds of matmuls per measured peak")
    parser.add_argument(
        "--peak-every", type=int, default=5, help="also measure the CPU peak every N steps (0: only before/after)"
    )
    parser.add_argument(
        "--data-config",
        default=str(ROOT / "configs" / "pretrain" / "shakespeare.yaml"),
        help="config whose data section is prepared",
    )
    parser.add_argument(
        "--data-dir", help="already prepared data (default: --data-config's corpus, prepared into a temp dir)"
    )
    parser.add_argument(
        "--override", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides (applied last)"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.fsdp_ac and args.contenders and args.contenders != ["lightning"]:
        parser.error("--fsdp-ac measures the Lightning path only (--contenders lightning)")
    contenders = args.contenders or (["lightning"] if args.fsdp_ac else list(CONTENDERS))
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = H100_BF16_TFLOPS
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        precisions = args.precision or ["32-true", "bf16-true"]
    else:
        precisions = args.precision or [None]  # the config's own
    os.environ.setdefault("WANDB_MODE", "disabled")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"

    with tempfile.TemporaryDirectory(prefix="bench-pretrain-") as scratch:
        scratch = Path(scratch)
        args.data_dir = args.data_dir or str(scratch / "data")
        # every config is checked before any compute
        configs = [build_config(args, p, scratch / "runs", f"{c}-{p}") for p in precisions for c in contenders]
        prepare_data(args)
        names = [c for _ in precisions for c in contenders]
        results = [measure(name, config, args) for name, config in zip(names, configs)]

    print_table(configs[0], args, results, device_name)
    if args.json:
        config = configs[0]
        Path(args.json).write_text(json.dumps({
            "benchmark": "pretrain", "mode": "fsdp-ac" if args.fsdp_ac else "compare", "device": device_name,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "preset": args.preset or Path(args.config).stem, "params": config.model.num_params(), "seq_len": config.loader.seq_len,
            "micro_batch": config.loader.micro_batch_size, "compile": config.trainer.compile, "flops_per_token": config.model.flops_per_token(config.loader.seq_len),
            "args": vars(args), "results": results,
        }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
