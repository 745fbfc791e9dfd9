"""
A real pretrained checkpoint (SmolLM2-135M-Instruct, from /work/shared/models' GGUF) on CPU: LoRA SFT throughput and
peak memory, and greedy decode throughput, Lantern against transformers (+ peft, + TRL when installed).

    python -m benchmarks.bench_real_model sft    [--steps 11] [--seq-len 256] [--micro-batch 8] [--threads 2]
    python -m benchmarks.bench_real_model decode [--batches 1 16] [--new-tokens 64] [--repeats 3] [--threads 2]

Setup (once, reused from --work): the GGUF converted to a native folder with
``models.formats.gguf_format.convert_gguf(gguf, DIR/native, "native")`` and to a Hugging Face folder with
``convert_gguf(gguf, DIR/hf, "hf")`` (both float32, same weights), so both sides start from identical fp32 weights.

``sft``: each contender in a fresh subprocess (peak RSS = that process's ``ru_maxrss``), same data (prompt/response
pairs cut from tinyshakespeare, rendered with SmolLM2's chat template), sequence length, micro batch, steps, lr
(2e-4, AdamW, no weight decay), LoRA r=16 alpha=32 dropout 0 on q k v o gate up down, fp32, packing on all sides
(Lantern packs the examples itself, with document masking; transformers and TRL get the same examples rendered,
tokenized and concatenated into full seq-len rows), so every step trains micro_batch x seq_len tokens. tokens/s is
steady state: tokens of steps 2..N over the wall time from the end of step 1 to the end of step N.
Contenders: lantern (``alignment.stages.sft.run_sft``), hf-trainer (``transformers.Trainer`` + peft), trl
(``trl.SFTTrainer`` with a peft_config, pre-packed rows), the last only if ``import trl`` works.

``decode``: both models loaded in one process, greedy, fp32, ``torch.set_num_threads(--threads)``, the same left-padded
prompts (lines of tinyshakespeare) and exactly --new-tokens new tokens (no stop token: Lantern stop_ids=(),
transformers min_new_tokens=max_new_tokens); Lantern ``models.generation.generate(temperature=0, decode=--decode)``
with its KV cache vs ``model.generate(do_sample=False)``; interleaved, --repeats times, median. New tokens/s =
batch x new tokens / seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GGUF = Path("/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")
CORPUS = REPO / "data" / "corpus" / "tinyshakespeare.txt"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RESULTS = REPO / "benchmarks/results/real_model.json"


def checkpoints(work: Path) -> tuple[Path, Path]:
    from models.formats.gguf_format import convert_gguf

    native, hf = work / "native", work / "hf"
    for path, fmt in ((native, "native"), (hf, "hf")):
        if not (path / "model.safetensors").is_file():
            convert_gguf(GGUF, path, fmt, overwrite=True)
    return native, hf


def make_sft_data(path: Path, n: int = 800, seed: int = 0) -> Path:
    """prompt/response pairs: a paragraph of tinyshakespeare and the one after it (seeded choice)."""
    paras = [p.strip() for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            i = rng.randrange(len(paras) - 1)
            f.write(
                json.dumps({"prompt": "Continue the play:\n" + paras[i][:300], "response": paras[i + 1][:400]}) + "\n"
            )
    return path


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def packed_rows(hf_dir: Path, data: Path, seq_len: int) -> list[list[int]]:
    """The examples rendered with the checkpoint's chat template, tokenized, concatenated, cut into seq_len rows."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    stream: list[int] = []
    for line in data.read_text().splitlines():
        ex = json.loads(line)
        msgs = [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["response"]}]
        ids = tok.apply_chat_template(msgs, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        stream += list(ids)
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def sft_worker(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    native, hf_dir = Path(args.work) / "native", Path(args.work) / "hf"
    data = Path(args.work) / "sft.jsonl"
    marks: list[tuple[float, int]] = []  # (time at the end of a step, tokens of that step)
    rss_loaded = None
    if args.contender.startswith("lantern"):
        import lightning as L

        from alignment.schemas.sft import SFTConfig
        from alignment.stages.sft import run_sft
        from trainer.config import load_config

        class Timer(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                marks.append((time.perf_counter(), int(batch["input_ids"].numel())))

        overrides = [
            "run.name=bench-lantern", f"run.out_dir={args.work}/runs", f"init.checkpoint={native}",
            "peft.kind=lora", "peft.rank=16", "peft.alpha=32", "peft.dropout=0.0",
            "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
            f"data.train=[{data}]", "data.tokenizer=auto", f"data.seq_len={args.seq_len}", "data.packing=true",
            f"loader.micro_batch_size={args.micro_batch}", "optim.lr=2e-4", "optim.min_lr=2e-4", "optim.warmup_steps=0",
            "optim.weight_decay=0.0", "trainer.accelerator=cpu", "trainer.precision=32-true",
            f"trainer.compile={str(args.contender == 'lantern-compiled').lower()}",
            f"trainer.max_steps={args.steps}", "trainer.val_every_n_steps=100000", "trainer.log_every_n_steps=1000",
            "checkpoint.every_n_steps=100000", "checkpoint.resume=none", "logger.kind=csv", "eval.generations=0",
        ]  # fmt: skip
        config = load_config(SFTConfig, None, overrides)
        run_sft(config, extra_callbacks=[Timer()])
    else:
        from peft import LoraConfig, get_peft_model
        from torch.utils.data import Dataset
        from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

        rows = packed_rows(hf_dir, data, args.seq_len)

        class Rows(Dataset):
            def __len__(self):
                return len(rows)

            def __getitem__(self, i):
                ids = torch.tensor(rows[i])
                return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

        class Timer(TrainerCallback):
            def on_step_end(self, a, state, control, **kw):
                marks.append((time.perf_counter(), args.micro_batch * args.seq_len))

        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        common = dict(
            output_dir=f"{args.work}/runs/{args.contender}", per_device_train_batch_size=args.micro_batch,
            max_steps=args.steps, learning_rate=2e-4, weight_decay=0.0, lr_scheduler_type="constant",
            warmup_steps=0, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1000,
            dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        if args.contender == "hf-trainer":
            from transformers import Trainer

            trainer = Trainer(model=get_peft_model(model, lora), args=TrainingArguments(**common),
                              train_dataset=Rows(), callbacks=[Timer()])  # fmt: skip
        else:
            from datasets import Dataset as HFDataset
            from trl import SFTConfig as TRLConfig
            from trl import SFTTrainer

            ds = HFDataset.from_dict({"input_ids": rows})
            trainer = SFTTrainer(model=model, args=TRLConfig(**common, max_length=args.seq_len, packing=False),
                                 train_dataset=ds, peft_config=lora, callbacks=[Timer()])  # fmt: skip
        trainer.train()
    steady = marks[1:]
    secs = steady[-1][0] - marks[0][0]
    tokens = sum(t for _, t in steady)
    return {"contender": args.contender, "steps": len(marks), "tokens_per_step": marks[-1][1], "steady_s": secs,
            "tokens_per_s": tokens / secs, "peak_rss_mib": peak_rss_mib(), "rss_loaded": rss_loaded}  # fmt: skip


def run_sft_bench(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    checkpoints(work)
    make_sft_data(work / "sft.jsonl")
    contenders = [c for c in args.contenders if c != "trl"]
    if "trl" in args.contenders:
        try:
            import trl  # noqa: F401

            contenders.append("trl")
        except ImportError:
            print("trl not installed: skipped")
    results = []
    for name in contenders:
        shutil.rmtree(work / "runs", ignore_errors=True)  # a fresh run: nothing to resume
        cmd = [sys.executable, "-m", "benchmarks.bench_real_model", "sft", "--worker", name, "--work", str(work),
               "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
               "--threads", str(args.threads)]  # fmt: skip
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            print(f"{name} failed:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
            results.append({"contender": name, "error": done.stderr[-500:]})
            continue
        r = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])
        r["process_s"] = time.perf_counter() - t0
        results.append(r)
        print(f"  {name:<11} {r['tokens_per_s']:8.1f} tok/s  peak RSS {r['peak_rss_mib']:7.0f} MiB", flush=True)
    ok = [r for r in results if "error" not in r]
    peers = [r for r in ok if not r["contender"].startswith("lantern")]
    ours = [r for r in ok if r["contender"].startswith("lantern")]
    lantern = max(ours, key=lambda r: r["tokens_per_s"]) if ours else None
    fastest = max(peers, key=lambda r: r["tokens_per_s"]) if peers else None
    for r in ok:
        r["vs_fastest_peer"] = r["tokens_per_s"] / fastest["tokens_per_s"] if fastest else None
    summary = {"seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps, "threads": args.threads,
               "results": results, "fastest_peer": fastest and fastest["contender"]}  # fmt: skip
    if lantern and fastest:
        summary["goal_1_3x_fastest_peer_at_le_memory"] = bool(
            lantern["vs_fastest_peer"] >= 1.3 and lantern["peak_rss_mib"] <= fastest["peak_rss_mib"]
        )
    return summary


def run_decode_bench(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.formats.checkpoint import load_checkpoint
    from models.generation import generate

    torch.set_num_threads(args.threads)
    native, hf_dir = checkpoints(Path(args.work))
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ours = load_checkpoint(native, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    lines = [x for x in CORPUS.read_text().splitlines() if len(x) > 20]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tok.padding_side = "left"
    # both decode every one of new_tokens greedily, past <|im_end|> (Lantern: stop_ids=()); min_new_tokens would
    # instead mask <|im_end|>'s logit and change the greedy tokens of a row that wants to stop
    theirs.generation_config.eos_token_id = None
    out: dict = {"new_tokens": args.new_tokens, "threads": args.threads, "decode": args.decode, "batches": {}}
    for bsz in args.batches:
        prompts = [tok(lines[i * 7])["input_ids"] for i in range(bsz)]

        def lantern(prompts=prompts):
            return generate(ours, prompts, max_new_tokens=args.new_tokens, temperature=0.0, pad_id=pad,
                            stop_ids=(), decode=args.decode).tokens  # fmt: skip

        enc = tok.pad({"input_ids": prompts}, return_tensors="pt")

        def hf(enc=enc):
            with torch.inference_mode():
                o = theirs.generate(**enc, do_sample=False, max_new_tokens=args.new_tokens, pad_token_id=pad)
            return o[:, enc["input_ids"].shape[1] :]

        lantern(), hf()  # warm-up (first-call allocations, kernels)
        times: dict[str, list[float]] = {"lantern": [], "transformers": []}
        for rep in range(args.repeats):
            for name, fn in (("lantern", lantern), ("transformers", hf))[:: 1 if rep % 2 == 0 else -1]:
                t0 = time.perf_counter()
                toks = fn()
                times[name].append(time.perf_counter() - t0)
                if name == "lantern":
                    lt = toks
                else:
                    ht = toks
        same = float((lt[:, : args.new_tokens] == ht).float().mean())
        row = {k: {"seconds": v, "median_s": statistics.median(v),
                   "new_tokens_per_s": bsz * args.new_tokens / statistics.median(v)} for k, v in times.items()}  # fmt: skip
        row["lantern_vs_transformers"] = row["lantern"]["new_tokens_per_s"] / row["transformers"]["new_tokens_per_s"]
        row["greedy_tokens_equal_fraction"] = same
        out["batches"][str(bsz)] = row
        print(f"  batch {bsz:>2}: lantern {row['lantern']['new_tokens_per_s']:7.1f} tok/s, transformers "
              f"{row['transformers']['new_tokens_per_s']:7.1f} tok/s, ratio {row['lantern_vs_transformers']:.2f}, "
              f"same greedy tokens {same:.3f}", flush=True)  # fmt: skip
    return out


def update_results(path: Path, key: str, value: dict) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    value = {**value, "cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0],
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path} [{key}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    default_work = str(Path(tempfile.gettempdir()) / "lantern-bench-real-model")
    s = sub.add_parser("sft", help="LoRA SFT tokens/s and peak RSS")
    s.add_argument("--steps", type=int, default=11)
    s.add_argument("--seq-len", type=int, default=256)
    s.add_argument("--micro-batch", type=int, default=8)
    s.add_argument(
        "--contenders",
        nargs="+",
        default=["lantern", "lantern-compiled", "hf-trainer", "trl"],
        help="lantern-compiled: trainer.compile=true (inductor on CPU; its compile time is outside the timed steps)",
    )
    s.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    d = sub.add_parser("decode", help="greedy decode tokens/s")
    d.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    d.add_argument("--new-tokens", type=int, default=64)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--decode", default="eager", help="Lantern's decode mode (eager | static | compiled | auto)")
    for p in (s, d):
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--work", default=default_work, help="where the converted checkpoints and data are kept")
        p.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.part == "sft" and args.worker:
        args.contender = args.worker
        print("RESULT " + json.dumps(sft_worker(args)), flush=True)
        return
    print(f"{args.part}: {os.cpu_count()} CPUs, {args.threads} threads, load {os.getloadavg()[0]:.1f}\n", flush=True)
    result = run_sft_bench(args) if args.part == "sft" else run_decode_bench(args)
    key = args.part if args.part == "decode" or len(args.contenders) == 4 else f"sft-{'-'.join(args.contenders)}"
    update_results(args.json, key, result)


if __name__ == "__main__":
    main()
