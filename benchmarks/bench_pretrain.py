"""Pretraining throughput, MFU and data-loader share, measured through the real Lightning training path.

Each precision is a short ``Trainer.fit`` built exactly as ``run_pretrain`` builds it (PretrainModule,
PretrainDataModule, ``make_trainer``, the DataProgress and Throughput callbacks), without validation,
checkpoints or export, plus a timing callback:

* **tokens/s** -- tokens per optimizer step / wall time per step (forward, backward, gradient clipping, AdamW,
  schedule, Lightning's loop and logging), over ``--steps`` steps after ``--warmup`` warm-up steps;
* **MFU** -- tokens/s x ``ModelConfig.flops_per_token(seq_len)`` / peak, where the peak is a square matmul
  (``trainer.callbacks.measure_matmul_flops``, ``--peak-size``) MEASURED IN THE SAME RUN, in fp32 and in bf16,
  before, during (every ``--peak-every`` steps, time excluded from the steps) and after each training run; the
  best sample is the peak. MFU is reported against both dtypes (the one matching the training precision is the
  honest figure; on CUDA the datasheet peak of a known GPU is shown as well), at the mean step and, as the
  least disturbed figure on a shared machine, at the fastest step ("MFU best");
* **data wait** -- time from the end of one training batch (all callbacks done) to the start of the next
  (next batch from the DataLoader, transfer to the device, loop bookkeeping) as a share of the step; and, as a
  cross-check, the DataLoader iterated alone for the same number of batches, per batch, over the step time.

CPU (default: the ``small`` preset, seq_len 256, micro-batch 8, 2 threads, fp32 and bf16):

    python benchmarks/bench_pretrain.py [--preset small --seq-len 256 --micro-batch 8 --steps 20 --warmup 3
                                         --precision 32-true bf16-true --threads 2]

GPU (needs CUDA; Llama 3.2 1B shapes in bf16):

    python benchmarks/bench_pretrain.py --device cuda --preset llama3.2-1b --precision bf16-true \\
        --seq-len 2048 --micro-batch 4 [--override trainer.compile=true]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402


class StepTimer(L.Callback):
    """Wall-clock marks at the start and the end of every training batch (after the other callbacks' ends:
    it is registered last; on CUDA the end mark waits for the device).

    Every ``peak_every`` batches it also measures the matmul peaks (``measure``) right after its end mark, so
    that peak and training share the machine's conditions (a shared CPU box drifts); that time is excluded
    from the step it follows."""

    def __init__(self, measure=None, peak_every: int = 0) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.excluded: dict[int, float] = {}
        self.measure = measure
        self.peak_every = peak_every
        self.peaks: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        self.ends.append(end)
        if self.measure is not None and self.peak_every and len(self.ends) % self.peak_every == 0:
            self.peaks.append(self.measure())
            self.excluded[len(self.ends) - 1] = time.perf_counter() - end

    def steps(self, first: int, count: int) -> list[tuple[float, float]]:
        """(seconds, seconds waiting before the batch) for batches first .. first+count-1."""
        out = []
        for i in range(first, first + count):
            previous_end = self.ends[i - 1] + self.excluded.get(i - 1, 0.0)
            out.append((self.ends[i] - previous_end, self.starts[i] - previous_end))
        return out


def build_config(args: argparse.Namespace, precision: str, data_dir: Path, out_dir: Path):
    from trainer.config import PretrainConfig, load_config

    overrides = [
        f"model={args.preset}",
        f"data.out_dir={data_dir}",
        f"run.out_dir={out_dir}",
        f"run.name=bench-{precision}",
        f"loader.seq_len={args.seq_len}",
        f"loader.micro_batch_size={args.micro_batch}",
        f"loader.num_workers={args.num_workers}",
        f"trainer.precision={precision}",
        f"trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}",
        "trainer.strategy=single",
        "trainer.devices=1",
        "trainer.accumulate_grad_batches=1",
        f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.log_every_n_steps=1",
        "logger.kind=none",
        *args.override,
    ]
    return load_config(PretrainConfig, args.config, overrides)


def prepared_data(args: argparse.Namespace, scratch: Path) -> Path:
    from data.prepare import prepare
    from trainer.config import PretrainConfig, load_config

    data_dir = Path(args.data_dir) if args.data_dir else scratch / "data"
    config = load_config(PretrainConfig, args.config, [f"data.out_dir={data_dir}", *[o for o in args.override if o.startswith("data.")]])
    config.data.source = [s if Path(s).is_absolute() else str(ROOT / s) for s in config.data.source]
    prepare(config.data)  # idempotent: returns at once when the data is already there
    return data_dir


def loader_alone(config, batches: int) -> float:
    """Seconds per batch of the training DataLoader iterated on its own (what the step waits for at most)."""
    from trainer.pretrain import pretrain_datamodule

    datamodule = pretrain_datamodule(config)
    datamodule.setup("fit")
    iterator = iter(datamodule.train_dataloader())
    next(iterator)  # first batch: worker start-up, not steady state
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches


def train_once(config, args: argparse.Namespace) -> dict:
    from trainer.build import make_trainer, run_directory
    from trainer.callbacks import DataProgress, Throughput
    from trainer.pretrain import PretrainModule, pretrain_datamodule

    datamodule = pretrain_datamodule(config)
    timer = StepTimer(lambda: measure_peaks(args), args.peak_every)
    tokens_per_step = config.loader.micro_batch_size * config.loader.seq_len
    callbacks = [
        DataProgress(),
        # peak 1 FLOP/s: the "mfu" it logs is unused here; the benchmark measures its own peaks
        Throughput(tokens_per_step, config.model.flops_per_token(config.loader.seq_len), 1.0),
        timer,
    ]
    run_dir = run_directory(config.run.out_dir, config.run.name)
    trainer = make_trainer(config.trainer, run_dir=run_dir, callbacks=callbacks, logger=False, validate=False)
    timer.peaks.append(measure_peaks(args))
    trainer.fit(PretrainModule(config), datamodule=datamodule)
    timer.peaks.append(measure_peaks(args))
    assert len(timer.ends) == args.warmup + args.steps, f"expected {args.warmup + args.steps} batches, got {len(timer.ends)}"
    steps = timer.steps(args.warmup, args.steps)
    total = sum(seconds for seconds, _ in steps)
    median = statistics.median(seconds for seconds, _ in steps)
    return {
        "tokens_per_second": tokens_per_step * args.steps / total,
        "tokens_per_second_median_step": tokens_per_step / median,
        "tokens_per_second_best_step": tokens_per_step / min(seconds for seconds, _ in steps),
        "step_ms": 1000 * total / args.steps,
        "step_ms_median": 1000 * median,
        "step_ms_min_max": [1000 * min(s for s, _ in steps), 1000 * max(s for s, _ in steps)],
        "data_wait_share": sum(wait for _, wait in steps) / total,
        "loss": float(trainer.callback_metrics["train/loss"]),
        "loader_alone_share": loader_alone(config, args.steps) / (total / args.steps),
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        "peak_samples": timer.peaks,
        "peaks": {name: max(sample[name] for sample in timer.peaks) for name in timer.peaks[0]},
    }


def measure_peaks(args: argparse.Namespace) -> dict[str, float]:
    from trainer.callbacks import measure_matmul_flops

    device = torch.device(args.device)
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[name] = measure_matmul_flops(device, dtype, size=args.peak_size, seconds=args.peak_seconds)
    if args.device == "cuda":
        from trainer.callbacks import KNOWN_PEAK_TFLOPS

        name = torch.cuda.get_device_name()
        for key, tflops in KNOWN_PEAK_TFLOPS.items():
            if key in name:
                peaks["bf16 datasheet"] = tflops * 1e12
                break
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "pretrain" / "shakespeare.yaml"), help="base pretrain config")
    parser.add_argument("--preset", default="small", help="model preset (configs/model/NAME.yaml)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-true"], choices=["32-true", "bf16-true", "bf16-mixed"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (loader.num_workers)")
    parser.add_argument("--peak-size", type=int, help="square matmul size for the measured peak (default: 2048 on CPU, 8192 on CUDA)")
    parser.add_argument("--peak-seconds", type=float, default=0.5, help="seconds of matmuls per measured peak and dtype")
    parser.add_argument("--peak-every", type=int, default=5, help="also measure the peaks every N training steps (0: only before/after)")
    parser.add_argument("--data-dir", help="prepared data (default: the config's corpus, prepared into a temp dir)")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.peak_size is None:
        args.peak_size = 8192 if args.device == "cuda" else 2048
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")

    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="bench-pretrain-") as scratch:
        scratch = Path(scratch)
        data_dir = prepared_data(args, scratch)
        results = {}
        for precision in args.precision:
            config = build_config(args, precision, data_dir, scratch / "runs")
            results[precision] = train_once(config, args)

    flops_per_token = config.model.flops_per_token(args.seq_len)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print()
    print(f"pretraining benchmark: {device_name}; torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    print(
        f"model {args.preset}: {config.model.num_params() / 1e6:.1f}M parameters, {flops_per_token / 1e6:.1f} MFLOP/token "
        f"at seq_len {args.seq_len}; micro-batch {args.micro_batch} = {args.seq_len * args.micro_batch} tokens/step; "
        f"{args.steps} timed steps after {args.warmup} warm-up; document_masking={config.loader.document_masking}, "
        f"loss_chunk_size={config.trainer.loss_chunk_size}, compile={config.trainer.compile}"
    )
    print(
        f"peak: best {args.peak_size}x{args.peak_size} matmul FLOP/s measured in this run, before, during (every "
        f"{args.peak_every} steps) and after each precision's training, range in brackets"
    )
    header = (
        f"{'precision':<10} {'tokens/s':>9} {'median':>7} {'best':>7} {'step ms':>8} {'TFLOP/s':>8} {'fp32 peak TF':>20} "
        f"{'bf16 peak TF':>20} {'MFU/fp32':>9} {'MFU/bf16':>9} {'MFU best':>9} {'data wait':>10} {'loader':>7} {'loss':>6}"
    )
    print(header)
    print("-" * len(header))
    for precision, result in results.items():
        peaks = result["peaks"]
        own = "fp32" if precision == "32-true" else "bf16"
        achieved = result["tokens_per_second"] * flops_per_token
        result["achieved_tflops"] = achieved / 1e12
        result["mfu_vs_fp32_peak"] = achieved / peaks["fp32"]
        result["mfu_vs_bf16_peak"] = achieved / peaks["bf16"]
        result["mfu_best_step"] = result["tokens_per_second_best_step"] * flops_per_token / peaks[own]
        spread = {}
        for name in ("fp32", "bf16"):
            values = [sample[name] / 1e12 for sample in result["peak_samples"]]
            spread[name] = f"{max(values):.3f} [{min(values):.3f}-{max(values):.3f}]"
        print(
            f"{precision:<10} {result['tokens_per_second']:>9.0f} {result['tokens_per_second_median_step']:>7.0f} "
            f"{result['tokens_per_second_best_step']:>7.0f} {result['step_ms']:>8.1f} {achieved / 1e12:>8.3f} "
            f"{spread['fp32']:>20} {spread['bf16']:>20} {result['mfu_vs_fp32_peak']:>9.1%} "
            f"{result['mfu_vs_bf16_peak']:>9.1%} {result['mfu_best_step']:>9.1%} "
            f"{result['data_wait_share']:>10.2%} {result['loader_alone_share']:>7.2%} {result['loss']:>6.3f}"
        )
        if "bf16 datasheet" in peaks:
            print(f"{'':<10} MFU against the datasheet bf16 peak ({peaks['bf16 datasheet'] / 1e12:.0f} TF): {achieved / peaks['bf16 datasheet']:.1%}")
    print(
        "tokens/s: mean over the timed steps (median / best: from the median / fastest step); TFLOP/s: model FLOPs "
        "achieved at the mean (6N + 12·L·d·T per token); MFU/xx: TFLOP/s over the best xx matmul peak measured in this "
        "run; MFU best: the fastest step over the peak of the training dtype (both the least disturbed figures on a "
        "shared machine); data wait: share of step time between batches (DataLoader + transfer + loop); loader: the "
        "DataLoader alone, per batch, over the mean step time"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "device": device_name, "flops_per_token": flops_per_token,
                        "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
