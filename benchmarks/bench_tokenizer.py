"""
Tokenizer benchmark: BPE training time, encode throughput, compression.

    python -m benchmarks.bench_tokenizer [--corpus PATH] [--vocab 4096] [--repeats 3]

Timings are the best of --repeats runs (least disturbed by other processes).
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

from data.tokenizer.bpe import train_bpe
from data.tokenizer.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def chunks_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def main() -> None:
    default_corpus = REPO / "data" / "corpus" / "tinyshakespeare.txt"
    if not default_corpus.is_file():
        default_corpus = Path("/work/shared/data/tinyshakespeare.txt")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=default_corpus)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="encode_batch num_threads")
    args = ap.parse_args()

    text = args.corpus.read_text(encoding="utf-8")
    n_bytes = len(text.encode("utf-8"))
    print(f"corpus {args.corpus} ({n_bytes / 1e6:.2f} MB), {os.cpu_count()} CPUs, best of {args.repeats}\n")

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.tiktoken"
        secs, _ = best_time(lambda: train_bpe(args.corpus, args.vocab, out), args.repeats)
        print(f"train_bpe vocab {args.vocab}: {secs:.3f} s\n")

    lines = text.splitlines(keepends=True)
    chunks = chunks_of(text, 64 * 1024)
    tokenizers = {"default": Tokenizer.load("default"), "cl100k_base": Tokenizer.load("cl100k_base")}
    modes = {
        "encode(whole)": lambda tok: [tok.encode(text)],
        "encode x lines": lambda tok: [tok.encode(s) for s in lines],
        f"encode_batch(lines) t={args.threads}": lambda tok: tok.encode_batch(lines, num_threads=args.threads),
        "encode x 64KB chunks": lambda tok: [tok.encode(s) for s in chunks],
        f"encode_batch(64KB) t={args.threads}": lambda tok: tok.encode_batch(chunks, num_threads=args.threads),
    }

    header = f"{'tokenizer':<12} {'mode':<28} {'MB/s':>8} {'Mtok/s':>8} {'tokens':>9} {'bytes/tok':>9}"
    print(header)
    print("-" * len(header))
    for name, tok in tokenizers.items():
        for mode, fn in modes.items():
            secs, ids = best_time(lambda fn=fn, tok=tok: fn(tok), args.repeats)
            n_tok = sum(len(x) for x in ids)
            print(
                f"{name:<12} {mode:<28} {n_bytes / secs / 1e6:8.2f} {n_tok / secs / 1e6:8.2f} "
                f"{n_tok:9d} {n_bytes / n_tok:9.2f}"
            )


if __name__ == "__main__":
    main()
