"""
Code-checkable instruction tasks over the bundled Shakespeare corpus, for the CPU demo
(pretrain -> SFT -> reward model -> PPO).

Every task has a reference answer and a checker, so SFT, the reward model and PPO can all
be judged by a ground-truth score in [0, 1] instead of by eye:

    short (1-2 answer tokens)         long (several lines)
    first_speaker  -> "ROMEO"          repeat          -> the passage, copied
    mentions_word  -> "yes" / "no"     continue_speech -> the speech's next 1-3 lines
    line_count     -> "1".."4"

The default mix (30% short examples) makes long answers hold ~95% of the supervised
tokens on purpose: that is what the SFT experiment studies (a packed, token-averaged
loss barely sees the short answers).

Passages are 1-4 consecutive speech lines (<= 63 chars each in this corpus), so prompt +
answer stays well under 256 tokens with the default tokenizer.

Layout of a dataset written by write_demo_dataset(out_dir):
    train.jsonl    {"messages": [user, assistant], "task", "kind", "answer", "meta"}; with line_count_miscount
                   > 0, that share of line_count demonstrations answers one too many ("miscounted": true;
                   "answer" and meta keep the reference)
    val.jsonl      same, from speeches that never appear in train
    prompts.jsonl  val records without the assistant turn: the RL stages' held-out prompts
    train_prompts.jsonl  train records without the assistant turn: the RL stages' training prompts
    pairs.jsonl    {"prompt": [user], "chosen", "rejected", "task", "kind", "meta"} (train pool)
    demo_manifest.json   parameters; a matching manifest makes the call a no-op

    python -m data.demo.tasks OUT_DIR [--n-train N --n-val N --n-pairs N --seed S --line-count-miscount F]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from data.demo.corpus import DEFAULT_CORPUS, default_tokenizer
from data.demo.examples import (
    MAX_PASSAGE_LINES,
    TASKS,
    build_examples,
    build_pairs,
    check_line_count_miscount,
    miscount_line_counts,
    prompt_records,
)
from data.tokenizer.base import check_utf8
from models.errors import DataError
from models.files.atomic import write_atomically
from models.files.folders import claim_folder

# Bump when task formats, sampling or file layout change: it is part of the manifest, so
# an old dataset directory is rebuilt instead of silently reused.
FORMAT_VERSION = "lantern-demo-tasks-v1"


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON lines file; a bad line is named (file, line, and byte offset if mis-encoded)."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise DataError(f"{path}, line {lineno}: invalid JSON ({error.msg})") from None
    except UnicodeDecodeError:
        check_utf8(path)
        raise
    return records


def check_demo_arguments(out_dir: str | Path, *, n_train: int, n_val: int, n_pairs: int) -> None:
    """Every count is at least 1 and ``out_dir`` is, or can become, a folder."""
    for name, value, least in (("n_train", n_train, 1), ("n_val", n_val, 1), ("n_pairs", n_pairs, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise DataError(f"{name} must be an integer >= {least}, got {value!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"out {out} is a file; the demo data is a folder of files (give a folder path)")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"out {out}: {parent} is a file, not a folder")
            break


def _jsonl(records: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


DATA_FILES = {
    "train": "train.jsonl",
    "val": "val.jsonl",
    "prompts": "prompts.jsonl",
    "train_prompts": "train_prompts.jsonl",
    "pairs": "pairs.jsonl",
}
MANIFEST = "demo_manifest.json"


def write_demo_dataset(
    out_dir: str | Path,
    *,
    n_train: int = 4000,
    n_val: int = 400,
    n_pairs: int = 2000,
    seed: int = 0,
    corpus_path: str | Path = DEFAULT_CORPUS,
    short_share: float = 0.3,
    line_count_max: int = MAX_PASSAGE_LINES,
    line_count_miscount: float = 0.0,
    refuse_other_settings: bool = False,
    key: str = "--out",
) -> dict[str, Path]:
    """Write train/val/prompts/train_prompts/pairs.jsonl + demo_manifest.json under out_dir and return
    their paths ({"train", "val", "prompts", "train_prompts", "pairs", "manifest"}). A no-op when all files
    exist and the manifest records the same parameters. refuse_other_settings: a folder written with other
    parameters is refused (DataError naming them) instead of rewritten. A folder holding files Lantern did not write
    is refused in one line naming ``key``, the setting that chose it."""
    check_demo_arguments(out_dir, n_train=n_train, n_val=n_val, n_pairs=n_pairs)
    check_line_count_miscount(line_count_miscount, line_count_max)  # before any file is touched
    corpus_file = Path(corpus_path)
    params = {
        "format": FORMAT_VERSION,
        "n_train": n_train,
        "n_val": n_val,
        "n_pairs": n_pairs,
        "seed": seed,
        "short_share": short_share,
        "line_count_max": line_count_max,
        "corpus_sha256": hashlib.sha256(corpus_file.read_bytes()).hexdigest(),
        # first_speaker's name pool depends on the default tokenizer
        "tokenizer": default_tokenizer().fingerprint,
    }
    if line_count_miscount:  # recorded only when used: folders written before the option stay current
        params["line_count_miscount"] = line_count_miscount

    def build() -> dict[str, list[dict[str, Any]]]:
        shape = {"short_share": short_share, "line_count_max": line_count_max}
        train = build_examples(n_train, seed=seed, corpus_path=corpus_file, split="train", **shape)
        val = build_examples(n_val, seed=seed, corpus_path=corpus_file, split="val", **shape)
        return {
            "train": miscount_line_counts(train, line_count_miscount, seed=seed),  # SFT's demonstrations only
            "val": val,
            "prompts": prompt_records(val),
            "train_prompts": prompt_records(train),
            "pairs": build_pairs(n_pairs, seed=seed, corpus_path=corpus_file, split="train", **shape),
        }

    return write_task_files(out_dir, params, build, refuse_other_settings=refuse_other_settings, key=key)


def write_task_files(
    out_dir: str | Path,
    params: dict[str, Any],
    build: Callable[[], dict[str, list[dict[str, Any]]]],
    *,
    refuse_other_settings: bool,
    key: str,
) -> dict[str, Path]:
    """The files of ``DATA_FILES`` from ``build()`` and a manifest of ``params`` under ``out_dir`` (their paths, as
    ``write_demo_dataset`` returns them); a no-op when the manifest holds ``params`` and every file is there."""
    out = Path(out_dir)
    # its files are replaced on a rewrite: only in a folder Lantern made for the demo data (or an older one's)
    claim_folder(out, "demo data", key=key, adopt=lambda folder: (folder / MANIFEST).is_file())
    paths = {name: out / file for name, file in DATA_FILES.items()}
    paths["manifest"] = out / MANIFEST
    try:
        written = json.loads(paths["manifest"].read_text(encoding="utf-8")) if paths["manifest"].is_file() else None
    except (OSError, ValueError):
        written = {}  # unreadable: rebuilt, or refused below
    if written == params and all(p.exists() for p in paths.values()):
        return paths
    if refuse_other_settings and written is not None:
        recorded = written if isinstance(written, dict) else {}
        changed = sorted(k for k in {*recorded, *params} if recorded.get(k) != params.get(k))
        if changed:  # the same settings with a file missing is rebuilt, not refused
            raise DataError(
                f"{paths['manifest']}: the demo data was written with other settings ({', '.join(changed)}); "
                "give the ones it was written with (a pipeline's demo.* overrides)"
            )
    files = build()
    # Manifest goes first and comes back last: an interrupted rewrite leaves no manifest,
    # so the next call rebuilds instead of trusting a mix of old and new files.
    paths["manifest"].unlink(missing_ok=True)
    for name, records in files.items():
        write_atomically(paths[name], _jsonl(records), what="demo data file")
    write_atomically(paths["manifest"], json.dumps(params, indent=2) + "\n", what="demo data manifest")
    return paths


# -----------------------------------------------------------------------------
# statistics + CLI


def answer_tokens(records: Iterable[dict[str, Any]], tokenizer=None) -> list[tuple[str, str, int]]:
    """(task, kind, supervised tokens) per record: the answer's tokens (stripped, as
    encode_chat does) + 1 for <|eot_id|>."""
    tok = tokenizer or default_tokenizer()
    return [(r["task"], r["kind"], len(tok.encode(r["answer"].strip())) + 1) for r in records]


def short_token_share(records: Iterable[dict[str, Any]], tokenizer=None) -> float:
    counts = answer_tokens(records, tokenizer)
    total = sum(n for _, _, n in counts)
    return sum(n for _, kind, n in counts if kind == "short") / total if total else 0.0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.demo.tasks", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--n-val", type=int, default=400)
    parser.add_argument("--n-pairs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    parser.add_argument("--short-share", type=float, default=0.3, help="share of short-answer examples")
    parser.add_argument("--line-count-max", type=int, default=MAX_PASSAGE_LINES, help="longest line_count passage")
    parser.add_argument(
        "--line-count-miscount", type=float, default=0.0,
        help="share of line_count training demonstrations that answer one line too many",
    )  # fmt: skip
    args = parser.parse_args(argv)

    paths = write_demo_dataset(
        args.out_dir,
        n_train=args.n_train,
        n_val=args.n_val,
        n_pairs=args.n_pairs,
        seed=args.seed,
        corpus_path=args.corpus,
        short_share=args.short_share,
        line_count_max=args.line_count_max,
        line_count_miscount=args.line_count_miscount,
    )
    train = load_jsonl(paths["train"])
    for key in DATA_FILES:
        records = train if key == "train" else load_jsonl(paths[key])
        print(f"{key:8s} {len(records):6d}  {paths[key]}")
    counts = answer_tokens(train)
    print("train answer tokens (incl. <|eot_id|>) per task:")
    for name in TASKS:
        ns = [n for task, _, n in counts if task == name]
        if ns:
            print(f"  {name:16s} {TASKS[name].kind:5s} n={len(ns):5d} mean={statistics.mean(ns):6.2f} max={max(ns)}")
    print(f"short tasks' share of supervised answer tokens: {short_token_share(train):.1%}")


if __name__ == "__main__":
    main()
