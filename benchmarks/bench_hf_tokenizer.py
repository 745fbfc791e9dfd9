"""
`lantern prepare` against the raw encoders it wraps, on the same cores and the same documents: with a real
checkpoint's Hugging Face tokenizer (SmolLM2's tokenizer.json) against the `tokenizers` library's own batch encoder,
and with a tiktoken rank file (cl100k_base) against tiktoken's own batch encoder.

    python -m benchmarks.bench_hf_tokenizer [--size-mb 100] [--corpus python|shakespeare] [--repeats 3]
        [--threads 2] [--tokenizer-dir DIR] [--profile] [--json PATH]

Contenders (each timing in a fresh subprocess, so no contender inherits another's thread pools or caches; the timing
is taken inside it, around the call alone, so imports do not count; every subprocess gets RAYON_NUM_THREADS=--threads,
the size of the tokenizers library's thread pool; the order rotates over --repeats rounds, so load from other jobs
falls on every contender alike; the table gives the median):

    raw-tokenizers    tokenizers.Tokenizer.from_file(DIR/tokenizer.json).encode_batch_fast(docs), docs = the
                      documents prepare makes (paragraphs, stripped of newlines, whitespace-only ones dropped),
                      already in memory, all in one call: no reading, no ids taken out, nothing written; special-token
                      strings read as text, as prepare reads them
    raw-tokenizers-batches  the same in consecutive calls of RAW_BATCH_CHARS (1 MiB) of text, only the calls timed:
                      on 100 MB, faster than one call (whose millions of encodings outgrow the caches)
    raw-tokenizers-ids  the same batches with what a caller needs to have the token ids timed too: each encoding's
                      ``ids`` (the library gives them only as Python lists) and freeing the encodings (their token
                      strings and offsets); not counted as a raw baseline, shown to say where prepare's time goes
    prepare-hf        prepare(PrepareConfig(tokenizer=DIR, num_proc=--threads)): hash and check the inputs, load
                      them, encode, write the shards and the manifest
    raw-tiktoken      tiktoken.Encoding(cl100k_base's ranks and regex).encode_ordinary_batch(docs,
                      num_threads=--threads), the same documents
    prepare-tiktoken  prepare(PrepareConfig(tokenizer="cl100k_base", num_proc=--threads))

Ratios are equal work: raw seconds / prepare seconds, the medians, raw being the faster of a prepare's raw encoders
(the goal: >= 0.9), and the median of each round's own ratio; the same for CPU seconds (user + system, child processes included), which load from other jobs
moves less. Prepare's token count is the raw one plus BOS/EOS per document ("extra_tokens": any more than that).

Corpus: benchmarks/bench_prepare.CORPORA, --size-mb over --files text files; "python" (the default) is distinct text,
the installed Python sources' paragraphs each kept once; "shakespeare" repeats tinyshakespeare's paragraphs. DIR is
made once (and reused) with ``AutoTokenizer.from_pretrained(<models>, gguf_file=<gguf>).save_pretrained(DIR)``.
--profile runs prepare-hf once more under cProfile and prints the top functions.
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
# each prepare contender and its raw encoders: the ratio takes the fastest of them (median), the library at its best
PAIRS = {"prepare-hf": ["raw-tokenizers", "raw-tokenizers-batches"], "prepare-tiktoken": ["raw-tiktoken"]}
MODES = [
    "raw-tokenizers",
    "raw-tokenizers-batches",
    "raw-tokenizers-ids",
    "prepare-hf",
    "raw-tiktoken",
    "prepare-tiktoken",
]
RAW_BATCH_CHARS = 1 << 20  # raw-tokenizers-batches: text per call
GOAL = 0.9

WORKER = r"""
import json, os, resource, sys, time
mode, tok_dir, out, threads, corpus = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
RAW_BATCH_CHARS = int(os.environ["BENCH_RAW_BATCH_CHARS"])
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
def documents():  # prepare's documents for sample_by paragraph: datasets' text reader, then _tokenize_batch
    docs = []
    for path in corpus:
        text = open(path, encoding="utf-8").read()
        docs += [p.strip("\n") for p in text.split("\n\n") if p and not p.isspace()]
    return [d for d in docs if d]
if mode.startswith("raw-"):
    docs = documents()
    if mode.startswith("raw-tokenizers"):
        from tokenizers import Tokenizer
        tk = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        tk.encode_special_tokens = True  # as prepare: "<|im_end|>" in a document is text, not the special token
        encode = lambda docs: tk.encode_batch_fast(docs, add_special_tokens=False)
        count = lambda encoded: sum(len(e.ids) for e in encoded)
    else:
        import tiktoken
        from data.tokenizer.files import CL100K_PAT, read_cl100k
        ranks, _ = read_cl100k()  # the rank file's parse, the same as tiktoken.load's
        enc = tiktoken.Encoding("cl100k_base", pat_str=CL100K_PAT, mergeable_ranks=ranks, special_tokens={})
        encode = lambda docs: enc.encode_ordinary_batch(docs, num_threads=threads)
        count = lambda encoded: sum(map(len, encoded))
    batches, size = [[]], 0
    for doc in docs:  # one batch, or consecutive ones of RAW_BATCH_CHARS characters
        if mode.endswith(("-batches", "-ids")) and size >= RAW_BATCH_CHARS:
            batches.append([])
            size = 0
        batches[-1].append(doc)
        size += len(doc)
    secs = cpus = 0.0
    tokens, n_docs = 0, len(docs)
    for batch in batches:  # only the encoder's calls are timed (raw-tokenizers-ids: and taking the ids, freeing)
        c0, t0 = cpu(), time.perf_counter()
        encoded = encode(batch)
        if mode.endswith("-ids"):
            ids = [e.ids for e in encoded]
            del encoded
            encoded = ids
        secs, cpus = secs + time.perf_counter() - t0, cpus + cpu() - c0
        tokens += sum(map(len, encoded)) if mode.endswith("-ids") else count(encoded)
        del encoded
else:
    import datasets
    datasets.disable_progress_bars()
    from data.pretrain.config import PrepareConfig
    from data.pretrain.prepare import prepare
    tokenizer = "cl100k_base" if mode == "prepare-tiktoken" else tok_dir
    config = PrepareConfig(source=corpus, out_dir=out, tokenizer=tokenizer, num_proc=threads)
    c0, t0 = cpu(), time.perf_counter()
    if os.environ.get("BENCH_PROFILE"):
        import cProfile
        prof = cProfile.Profile()
        manifest = prof.runcall(prepare, config)
        prof.dump_stats(os.environ["BENCH_PROFILE"])
    else:
        manifest = prepare(config)
    secs, cpus = time.perf_counter() - t0, cpu() - c0
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    n_docs = sum(s["documents"] for s in manifest["splits"].values())
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print("RESULT " + json.dumps({"mode": mode, "seconds": secs, "cpu_s": cpus, "tokens": tokens, "docs": n_docs,
                              "peak_rss_mib": rss / 1024}))
"""


def tokenizer_dir(path: Path) -> Path:
    """SmolLM2's tokenizer files in ``path``, converted from its GGUF file unless already there."""
    if not (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(MODELS), gguf_file=GGUF).save_pretrained(str(path))
    return path


def run_one(mode: str, tok_dir: Path, out: Path, corpus: list[Path], threads: int, profile: str | None = None) -> dict:
    """One contender's timing, from a fresh subprocess, with the load average just before it."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "BENCH_RAW_BATCH_CHARS": str(RAW_BATCH_CHARS)}
    if profile:
        env["BENCH_PROFILE"] = profile
    load = os.getloadavg()[0]
    done = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(tok_dir), str(out), str(threads), *map(str, corpus)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[len("RESULT ") :]), "load_before": load}


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per contender: medians and every round; per prepare contender: its ratios to its raw encoder."""
    rows = {}
    for mode, rs in runs.items():
        secs = statistics.median(r["seconds"] for r in rs)
        rows[mode] = {
            "seconds_median": secs,
            "seconds": [r["seconds"] for r in rs],
            "cpu_s_median": statistics.median(r["cpu_s"] for r in rs),
            "cpu_s": [r["cpu_s"] for r in rs],
            "load_before": [r["load_before"] for r in rs],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),  # the whole process (its input and output too)
            "tokens": rs[0]["tokens"],
            "docs": rs[0]["docs"],
            "tokens_per_s": rs[0]["tokens"] / secs,
        }
    for mode, raw_modes in PAIRS.items():
        ours = rows[mode]
        for raw_mode in raw_modes:
            raw = rows[raw_mode]
            assert ours["docs"] == raw["docs"], (mode, ours["docs"], raw["docs"])  # the same documents
        # prepare's tokens are the raw ones plus BOS/EOS per document; a few more with tiktoken where a document
        # holds a run of over 25,000 (non-)space characters, which Lantern cuts as Meta's Llama 3 tokenizer does
        ours["extra_tokens"] = ours["tokens"] - rows[raw_modes[0]]["tokens"] - 2 * ours["docs"]
        best = min(raw_modes, key=lambda m: rows[m]["seconds_median"])
        rounds = [min(runs[m][k]["seconds"] for m in raw_modes) / r["seconds"] for k, r in enumerate(runs[mode])]
        ours["raw_baseline"] = best
        ours["vs_raw"] = rows[best]["seconds_median"] / ours["seconds_median"]
        ours["vs_raw_per_round"] = rounds  # each round's fastest raw encoder / prepare in that round
        ours["vs_raw_median_of_rounds"] = statistics.median(rounds)
        ours["vs_raw_cpu"] = min(rows[m]["cpu_s_median"] for m in raw_modes) / ours["cpu_s_median"]
    # where prepare's time goes: the raw encoder with its ids taken and its encodings freed (not a baseline)
    ids, ours = rows["raw-tokenizers-ids"], rows["prepare-hf"]
    ours["vs_raw_ids"] = ids["seconds_median"] / ours["seconds_median"]
    ours["vs_raw_ids_per_round"] = [
        a["seconds"] / b["seconds"] for a, b in zip(runs["raw-tokenizers-ids"], runs["prepare-hf"])
    ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=100.0)
    ap.add_argument("--files", type=int, default=4, help="text files the generated corpus is split over")
    ap.add_argument("--corpus", choices=["python", "shakespeare"], default="python")
    ap.add_argument("--threads", type=int, default=2, help="cores every contender gets (threads / num_proc)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokenizer-dir", type=Path, default=Path(tempfile.gettempdir()) / "lantern-smollm2-tokenizer")
    ap.add_argument("--profile", action="store_true", help="also profile one prepare-hf run with cProfile")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks/results/prepare_vs_raw.json")
    args = ap.parse_args()

    from benchmarks.bench_prepare import CORPORA, corpus_digest

    tok_dir = tokenizer_dir(args.tokenizer_dir)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "gen").mkdir()
        corpus = CORPORA[args.corpus](tmp / "gen", args.size_mb, args.files)
        size, digest = sum(p.stat().st_size for p in corpus), corpus_digest(corpus)
        print(f"{args.corpus} corpus {size / 1e6:.1f} MB in {args.files} files (sha256 {digest[:16]}), "
              f"{os.cpu_count()} CPUs, {args.threads} threads each, load {load_start[0]:.1f}, median of {args.repeats}\n",
              flush=True)  # fmt: skip
        for rep in range(args.repeats):
            order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]  # rotate: none always runs first
            for mode in order:
                r = run_one(mode, tok_dir, tmp / f"out-{mode}-{rep}", corpus, args.threads)
                runs[mode].append(r)
                print(f"  round {rep} {mode:<22} {r['seconds']:7.2f} s  {r['tokens'] / r['seconds']:>12,.0f} tok/s "
                      f"cpu {r['cpu_s']:6.1f} s  load before {r['load_before']:.1f}", flush=True)  # fmt: skip
        profile_top = None
        if args.profile:
            stats_file = tmp / "prepare.prof"
            run_one("prepare-hf", tok_dir, tmp / "out-profile", corpus, args.threads, profile=str(stats_file))
            import io
            import pstats

            buf = io.StringIO()
            pstats.Stats(str(stats_file), stream=buf).sort_stats("cumulative").print_stats(25)
            profile_top = buf.getvalue()
    load_end = os.getloadavg()

    rows = summarise(runs)
    header = (f"{'contender':<22} {'median s':>9} {'CPU s':>7} {'tokens':>12} {'tokens/s':>11} {'MB/s':>6} "
              f"{'raw/it s':>9} {'per round':>10} {'raw/it CPU':>11}")  # fmt: skip
    print("\n" + header + "\n" + "-" * len(header))
    for m, r in rows.items():
        ratios = (f"{r['vs_raw']:>9.3f} {r['vs_raw_median_of_rounds']:>10.3f} {r['vs_raw_cpu']:>11.3f}"
                  if "vs_raw" in r else "")  # fmt: skip
        print(f"{m:<22} {r['seconds_median']:>9.2f} {r['cpu_s_median']:>7.1f} {r['tokens']:>12,} "
              f"{r['tokens_per_s']:>11,.0f} {size / 1e6 / r['seconds_median']:>6.2f} {ratios}")  # fmt: skip
    print(f"prepare-hf against raw-tokenizers-ids (ids taken, encodings freed): {rows['prepare-hf']['vs_raw_ids']:.3f}, "
          f"per round {[round(x, 3) for x in rows['prepare-hf']['vs_raw_ids_per_round']]}")  # fmt: skip
    for mode in PAIRS:
        if rows[mode]["extra_tokens"]:
            print(f"{mode}: {rows[mode]['extra_tokens']} tokens more than its raw encoder's plus BOS/EOS")
    print(f"\nload average (1, 5, 15 min) at the start {load_start}, at the end {load_end}")
    if profile_top:
        print("\ncProfile of one prepare-hf run:")
        print(profile_top)
    result = {
        "benchmark": "bench_hf_tokenizer",
        "command": "python -m benchmarks.bench_hf_tokenizer " + " ".join(sys.argv[1:]),
        "corpus": args.corpus, "size_mb": size / 1e6, "files": args.files, "corpus_sha256": digest,
        "threads": args.threads, "repeats": args.repeats, "cpus": os.cpu_count(),
        "load_average_start": load_start, "load_average_end": load_end,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": rows, "goal_vs_raw": GOAL,
        "goal_met": {m: rows[m]["vs_raw"] >= GOAL for m in PAIRS},
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
