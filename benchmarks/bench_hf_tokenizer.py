"""
`prepare` with a real checkpoint's Hugging Face tokenizer (SmolLM2's tokenizer.json) against tiktoken and against
the raw `tokenizers` library's own batch encoder, on the same generated corpus.

    python -m benchmarks.bench_hf_tokenizer [--size-mb 100] [--repeats 3] [--num-proc 2] [--profile]

Contenders (each timing in a fresh subprocess, so no contender inherits another's thread pools or caches; the
timing is taken inside it, around the call alone, so imports do not count; the order is interleaved and repeated
--repeats times, the table gives the median):

    prepare-hf        prepare(PrepareConfig(tokenizer=DIR, num_proc=1)), DIR = SmolLM2's tokenizer files
                      (data/tokenizer/hf.py); the tokenizers library's own thread pool uses every core
    prepare-hf-np     the same with num_proc=--num-proc (datasets' map workers, each given the pickled tokenizer)
    prepare-tiktoken  prepare(PrepareConfig(tokenizer="cl100k_base"))
    raw-tokenizers    tokenizers.Tokenizer.from_file(DIR/tokenizer.json).encode_batch_fast(docs) over the same
                      documents prepare makes (paragraphs, stripped of newlines, whitespace-only ones dropped),
                      already in memory: no reading, no files written (a stricter baseline than prepare's job)

The ratio is equal work: raw-tokenizers seconds / prepare-hf seconds (the same documents; prepare's token count is
the raw one plus BOS/EOS per document, checked). Goal: >= 0.9.

Corpus: benchmarks/bench_prepare.make_corpus — tinyshakespeare's paragraphs shuffled with a seeded RNG (seed 0)
and repeated until --size-mb MB, over --files text files. DIR is made once (and reused) with
``AutoTokenizer.from_pretrained(<models>, gguf_file=<gguf>).save_pretrained(DIR)``.
--profile runs prepare-hf once more under cProfile (in the main process's child) and prints the top functions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO.parent / "shared" / "models"  # ../shared/models beside the checkout (its README.md)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

WORKER = r"""
import json, os, resource, sys, time
mode, tok_dir, out, corpus = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
if mode == "raw-tokenizers":
    from tokenizers import Tokenizer
    tk = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    docs = []
    for path in corpus:
        text = open(path, encoding="utf-8").read()
        docs += [p.strip("\n") for p in text.split("\n\n") if p and not p.isspace()]
    docs = [d for d in docs if d]
    c0, t0 = cpu(), time.perf_counter()
    enc = tk.encode_batch_fast(docs, add_special_tokens=False)
    secs, cpus = time.perf_counter() - t0, cpu() - c0
    tokens, n_docs = sum(len(e.ids) for e in enc), len(docs)
else:
    import datasets
    datasets.disable_progress_bars()
    from data.pretrain.config import PrepareConfig
    from data.pretrain.prepare import prepare
    tokenizer = "cl100k_base" if mode == "prepare-tiktoken" else tok_dir
    num_proc = 1 if mode == "prepare-hf" else int(os.environ["BENCH_NUM_PROC"])
    config = PrepareConfig(source=corpus, out_dir=out, tokenizer=tokenizer, num_proc=num_proc)
    c0, t0 = cpu(), time.perf_counter()
    if os.environ.get("BENCH_PROFILE"):
        import cProfile, pstats
        prof = cProfile.Profile()
        manifest = prof.runcall(prepare, config)
        prof.dump_stats(os.environ["BENCH_PROFILE"])
    else:
        manifest = prepare(config)
    secs, cpus = time.perf_counter() - t0, cpu() - c0
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    n_docs = sum(s["documents"] for s in manifest["splits"].values())
print("RESULT " + json.dumps({"mode": mode, "seconds": secs, "cpu_s": cpus, "tokens": tokens, "docs": n_docs}))
"""


def tokenizer_dir(path: Path) -> Path:
    if not (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(MODELS), gguf_file=GGUF).save_pretrained(str(path))
    return path


def run_one(mode: str, tok_dir: Path, out: Path, corpus: list[Path], num_proc: int, profile: str | None = None) -> dict:
    env = {**os.environ, "BENCH_NUM_PROC": str(num_proc)}
    if profile:
        env["BENCH_PROFILE"] = profile
    done = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(tok_dir), str(out), *map(str, corpus)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--files", type=int, default=4, help="text files the generated corpus is split over")
    ap.add_argument("--num-proc", type=int, default=2, help="num_proc of prepare-hf-np and prepare-tiktoken")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizer-dir", type=Path, default=Path(tempfile.gettempdir()) / "lantern-smollm2-tokenizer")
    ap.add_argument("--profile", action="store_true", help="also profile one prepare-hf run with cProfile")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks/results/real_model_tokenizer.json")
    args = ap.parse_args()

    from benchmarks.bench_prepare import make_corpus

    tok_dir = tokenizer_dir(args.tokenizer_dir)
    modes = ["raw-tokenizers", "prepare-hf", "prepare-hf-np", "prepare-tiktoken"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "gen").mkdir()
        corpus = make_corpus(tmp / "gen", args.size_mb, args.files)
        size = sum(p.stat().st_size for p in corpus)
        print(f"corpus {size / 1e6:.1f} MB in {args.files} files, {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.1f}, median of {args.repeats}\n", flush=True)  # fmt: skip
        for rep in range(args.repeats):
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # rotate: none always runs first
            for mode in order:
                r = run_one(mode, tok_dir, tmp / f"out-{mode}-{rep}", corpus, args.num_proc)
                runs[mode].append(r)
                print(f"  rep {rep} {mode:<17} {r['seconds']:7.2f} s  {r['tokens'] / r['seconds']:>12,.0f} tok/s "
                      f"cpu {r['cpu_s']:6.1f} s", flush=True)  # fmt: skip
        profile_top = None
        if args.profile:
            stats_file = tmp / "prepare.prof"
            run_one("prepare-hf", tok_dir, tmp / "out-profile", corpus, args.num_proc, profile=str(stats_file))
            import io
            import pstats

            buf = io.StringIO()
            pstats.Stats(str(stats_file), stream=buf).sort_stats("cumulative").print_stats(25)
            profile_top = buf.getvalue()

    def summary(mode: str) -> dict:
        rs = runs[mode]
        secs = statistics.median(r["seconds"] for r in rs)
        return {"seconds_median": secs, "seconds": [r["seconds"] for r in rs], "cpu_s": [r["cpu_s"] for r in rs],
                "tokens": rs[0]["tokens"], "docs": rs[0]["docs"], "tokens_per_s": rs[0]["tokens"] / secs}  # fmt: skip

    rows = {m: summary(m) for m in modes}
    raw = rows["raw-tokenizers"]
    for hf in (rows["prepare-hf"], rows["prepare-hf-np"]):
        assert hf["docs"] == raw["docs"], (hf["docs"], raw["docs"])  # the same documents
        assert hf["tokens"] == raw["tokens"] + 2 * raw["docs"], (hf["tokens"], raw["tokens"])  # + BOS, EOS each
    for m in modes:
        rows[m]["vs_raw_equal_work"] = raw["seconds_median"] / rows[m]["seconds_median"]
    header = f"{'contender':<18} {'median s':>9} {'tokens':>13} {'tokens/s':>12} {'MB/s':>7} {'vs raw (same work)':>19}"
    print("\n" + header + "\n" + "-" * len(header))
    for m, r in rows.items():
        print(f"{m:<18} {r['seconds_median']:>9.2f} {r['tokens']:>13,} {r['tokens_per_s']:>12,.0f} "
              f"{size / 1e6 / r['seconds_median']:>7.2f} {r['vs_raw_equal_work']:>19.3f}")  # fmt: skip
    print("\n(prepare-tiktoken's tokens are cl100k_base's: its ratio compares seconds on the same text)")
    if profile_top:
        print("\ncProfile of one prepare-hf run (parent process; the map workers are separate processes):")
        print(profile_top)
    result = {"benchmark": "bench_hf_tokenizer", "size_mb": size / 1e6, "files": args.files,
              "num_proc": args.num_proc, "repeats": args.repeats, "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": rows,
              "goal_prepare_hf_vs_raw": 0.9, "goal_met": {m: rows[m]["vs_raw_equal_work"] >= 0.9 for m in ("prepare-hf", "prepare-hf-np")}}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
