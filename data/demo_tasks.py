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
    train.jsonl    {"messages": [user, assistant], "task", "kind", "answer", "meta"}
    val.jsonl      same, from speeches that never appear in train
    prompts.jsonl  val records without the assistant turn (the PPO prompt set)
    pairs.jsonl    {"prompt": [user], "chosen", "rejected", "task", "kind", "meta"} (train pool)
    demo_manifest.json   parameters; a matching manifest makes the call a no-op

    python -m data.demo_tasks OUT_DIR [--n-train N --n-val N --n-pairs N --seed S]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import re
import statistics
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.prepare import check_utf8
from models.errors import DataError

DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus" / "tinyshakespeare.txt"

# Bump when task formats, sampling or file layout change: it is part of the manifest, so
# an old dataset directory is rebuilt instead of silently reused.
FORMAT_VERSION = "lantern-demo-tasks-v1"

# The train/val split uses a FIXED seed, independent of the sampling seed: val speeches are
# the same for every seed, so "val is unseen" holds even when train and val come from
# different seeds.
SPLIT_SEED = "lantern-demo-split-v1"
SPLIT_BLOCK = 32  # consecutive speeches per split unit: passages never straddle the split
VAL_FRACTION = 0.1

MAX_PASSAGE_LINES = 4
MAX_SHORT_ANSWER_TOKENS = 2  # first_speaker only asks about names this short
VOCAB_SIZE = 300  # common corpus words used as "no" probes for mentions_word

_WORD_RE = re.compile(r"[a-z]+")


# -----------------------------------------------------------------------------
# corpus: speeches, split pools, passages


@dataclass(frozen=True)
class Speech:
    idx: int  # position in the corpus (blank-line separated blocks), stable across seeds
    speaker: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Passage:
    """1-4 consecutive speech lines; each item is (speech idx, speaker, line)."""

    items: tuple[tuple[int, str, str], ...]

    @property
    def text(self) -> str:
        # Same layout as the corpus the model was pretrained on: "NAME:" header, then the
        # lines; a blank line between speeches.
        groups: list[tuple[int, str, list[str]]] = []
        for idx, speaker, line in self.items:
            if not groups or groups[-1][0] != idx:
                groups.append((idx, speaker, []))
            groups[-1][2].append(line)
        return "\n\n".join(f"{speaker}:\n" + "\n".join(lines) for _, speaker, lines in groups)

    @property
    def first_speaker(self) -> str:
        return self.items[0][1]

    @property
    def speakers(self) -> list[str]:
        return list(dict.fromkeys(speaker for _, speaker, _ in self.items))

    @property
    def speech_ids(self) -> list[int]:
        return list(dict.fromkeys(idx for idx, _, _ in self.items))


def parse_speeches(text: str) -> list[Speech]:
    """Blank-line separated blocks whose first line is "NAME:". Header-only blocks (the
    corpus dropped their stage directions) carry no lines and are skipped."""
    speeches = []
    for idx, block in enumerate(b for b in re.split(r"\n\s*\n", text) if b.strip()):
        head, *lines = block.strip("\n").split("\n")
        if not head.endswith(":") or not lines:
            continue
        lines = [line.strip() for line in lines if line.strip()]
        if lines:
            speeches.append(Speech(idx, head[:-1].strip(), tuple(lines)))
    return speeches


@functools.lru_cache(maxsize=4)
def _corpus_cached(path: str, mtime_ns: int) -> Corpus:
    return Corpus(parse_speeches(Path(path).read_text(encoding="utf-8")))


def load_corpus(corpus_path: str | Path = DEFAULT_CORPUS) -> Corpus:
    path = Path(corpus_path).resolve()
    return _corpus_cached(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _default_tokenizer():
    from data.tokenizer import Tokenizer  # lazy: scoring does not need tiktoken

    return Tokenizer.load("default")


class Corpus:
    """Parsed speeches plus corpus-wide tables the tasks sample from (all in a
    deterministic order: no set iteration, so output does not depend on PYTHONHASHSEED)."""

    def __init__(self, speeches: list[Speech]):
        if not speeches:
            raise ValueError("corpus has no speeches ('NAME:' header followed by lines)")
        self.speeches = speeches
        tok = _default_tokenizer()
        names = sorted({s.speaker for s in speeches})
        # Short-answer tasks must stay 1-2 tokens; long names ("KING RICHARD III") are
        # never asked about or used as wrong answers. (encode_chat strips content, so the
        # bare name is exactly what gets tokenized.)
        self.short_names = [n for n in names if len(tok.encode(n)) <= MAX_SHORT_ANSWER_TOKENS]
        self.short_name_set = frozenset(self.short_names)
        name_words = {w for n in names for w in _WORD_RE.findall(n.lower())}
        counts = Counter(w for s in speeches for line in s.lines for w in _WORD_RE.findall(line.lower()))
        # Probe words for mentions_word: frequent, >= 3 letters, never part of a speaker
        # name (so a "KING:" header cannot make a "no" word present by accident).
        self.vocab = [w for w, _ in counts.most_common() if len(w) >= 3 and w not in name_words][:VOCAB_SIZE]
        self.vocab_set = frozenset(self.vocab)

    def pool(self, split: str) -> Pool:
        if split == "all":
            return Pool(self, [self.speeches])
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'all', 'train' or 'val', got {split!r}")
        blocks = [self.speeches[i : i + SPLIT_BLOCK] for i in range(0, len(self.speeches), SPLIT_BLOCK)]
        order = list(range(len(blocks)))
        random.Random(SPLIT_SEED).shuffle(order)
        n_val = max(1, round(VAL_FRACTION * len(blocks)))
        chosen = sorted(order[:n_val]) if split == "val" else sorted(order[n_val:])
        return Pool(self, [blocks[i] for i in chosen])


class Pool:
    """Speeches of one split, kept as contiguous blocks so a passage may run across
    speeches of one block but never across the train/val boundary."""

    def __init__(self, corpus: Corpus, blocks: list[list[Speech]]):
        self.corpus = corpus
        self.blocks = [[(s.idx, s.speaker, line) for s in block for line in s.lines] for block in blocks]
        self.speeches = [s for block in blocks for s in block]
        self.multi_line = [s for s in self.speeches if len(s.lines) >= 2]  # continue_speech needs >= 2
        self._weights = [len(b) for b in self.blocks]

    def passage(self, rng: random.Random, n_lines: int, first: Callable[[str], bool] = lambda s: True) -> Passage:
        """A window of n_lines consecutive lines inside one block whose first speaker passes `first`."""
        for _ in range(10_000):
            (block,) = rng.choices(self.blocks, weights=self._weights)
            if len(block) < n_lines:
                continue
            start = rng.randrange(len(block) - n_lines + 1)
            items = tuple(block[start : start + n_lines])
            if first(items[0][1]):
                return Passage(items)
        raise RuntimeError(f"could not sample a {n_lines}-line passage from this pool")


# -----------------------------------------------------------------------------
# tasks: one small generator each, returning (prompt, answer, meta). meta always holds
# "answer" and whatever else its checker needs, so score(task, meta, response) is
# self-contained and JSON-serialisable.

TaskOutput = tuple[str, str, dict[str, Any]]


def _passage_meta(p: Passage, answer: str) -> dict[str, Any]:
    return {"answer": answer, "passage": p.text, "speakers": p.speakers, "speech_ids": p.speech_ids}


def make_first_speaker(pool: Pool, rng: random.Random, i: int) -> TaskOutput:
    short = pool.corpus.short_name_set
    p = pool.passage(rng, rng.randint(1, MAX_PASSAGE_LINES), first=lambda s: s in short)
    return f"Who speaks first in this passage?\n\n{p.text}", p.first_speaker, _passage_meta(p, p.first_speaker)


def _mentions(word: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text.lower()) is not None


def make_mentions_word(pool: Pool, rng: random.Random, i: int) -> TaskOutput:
    want_yes = i % 2 == 0  # alternate: exactly balanced yes/no (records are shuffled later)
    # Word first, uniformly from one vocabulary for both answers, then a passage that does
    # (or does not) contain it: the word alone says nothing about the answer, so the model
    # has to read the passage. The length is drawn once, up front, so "yes" passages are
    # not longer on average. Rare words can take a while to hit: retry with another word.
    n_lines = rng.randint(1, MAX_PASSAGE_LINES)
    while True:
        word = rng.choice(pool.corpus.vocab)
        for _ in range(500):
            p = pool.passage(rng, n_lines)
            if _mentions(word, p.text) == want_yes:
                answer = "yes" if want_yes else "no"
                prompt = f'Does the word "{word}" appear in this passage? Answer yes or no.\n\n{p.text}'
                return prompt, answer, {**_passage_meta(p, answer), "word": word}


def make_line_count(pool: Pool, rng: random.Random, i: int) -> TaskOutput:
    n = rng.randint(1, MAX_PASSAGE_LINES)
    p = pool.passage(rng, n)
    # "lines of speech": the "NAME:" headers and blank lines are not counted, which the
    # prompt says so the question has one reading.
    prompt = f"How many lines of speech does this passage have? Answer with a digit.\n\n{p.text}"
    return prompt, str(n), _passage_meta(p, str(n))


def make_repeat(pool: Pool, rng: random.Random, i: int) -> TaskOutput:
    p = pool.passage(rng, rng.randint(1, MAX_PASSAGE_LINES))
    return f"Repeat this passage exactly.\n\n{p.text}", p.text, _passage_meta(p, p.text)


def make_continue_speech(pool: Pool, rng: random.Random, i: int) -> TaskOutput:
    s = rng.choice(pool.multi_line)
    n_shown = rng.randint(1, min(2, len(s.lines) - 1))
    n_next = rng.randint(1, min(3, len(s.lines) - n_shown))
    shown, answer = "\n".join(s.lines[:n_shown]), "\n".join(s.lines[n_shown : n_shown + n_next])
    prompt = f"Continue this speech by {s.speaker}:\n\n{shown}"
    meta = {"answer": answer, "speaker": s.speaker, "speech_ids": [s.idx], "n_shown": n_shown}
    return prompt, answer, meta


# -----------------------------------------------------------------------------
# checkers: never raise on response text, always return a float in [0, 1]


def _nonblank_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _lcs_len(a: Sequence[str], b: Sequence[str]) -> int:
    """Longest common subsequence length, O(len(a) * len(b)) with one row of memory."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, start=1):
            prev_diag, row[j] = row[j], prev_diag + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def check_exact(meta: dict[str, Any], response: str) -> float:
    return float(response.strip() == meta["answer"])


# Enough response lines to match every reference line; beyond that the score is already
# <= n_ref / n_resp, so long garbage costs no quadratic work.
_MAX_COMPARED_LINES = 256


def check_repeat(meta: dict[str, Any], response: str) -> float:
    """Reference lines reproduced exactly and in order (LCS over stripped, non-blank lines),
    divided by max(#reference, #response) lines: 1.0 only for an exact copy, and padding a
    copy with extra lines is penalised (a reward PPO cannot game by repeating)."""
    ref = _nonblank_lines(meta["answer"])
    got = _nonblank_lines(response)
    if not ref or not got:
        return float(ref == got)
    return _lcs_len(ref, got[:_MAX_COMPARED_LINES]) / max(len(ref), len(got))


def token_f1(reference: str, response: str) -> float:
    """SQuAD-style overlap F1 over whitespace tokens (multiset intersection)."""
    ref, got = reference.split(), response.split()
    if not ref or not got:
        return float(ref == got)
    overlap = sum((Counter(ref) & Counter(got)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(got), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def check_f1(meta: dict[str, Any], response: str) -> float:
    return token_f1(meta["answer"], response)


# -----------------------------------------------------------------------------
# wrong answers for preference pairs: one rule per task


def reject_speaker(pool: Pool, rng: random.Random, meta: dict[str, Any]) -> str:
    answer = meta["answer"]
    others = [s for s in meta["speakers"] if s != answer and s in pool.corpus.short_name_set]
    if others and rng.random() < 0.5:  # hard negative: someone else who speaks in the passage
        return rng.choice(others)
    return rng.choice([n for n in pool.corpus.short_names if n != answer])


def reject_yes_no(pool: Pool, rng: random.Random, meta: dict[str, Any]) -> str:
    return "no" if meta["answer"] == "yes" else "yes"


def reject_digit(pool: Pool, rng: random.Random, meta: dict[str, Any]) -> str:
    return rng.choice([str(d) for d in range(1, MAX_PASSAGE_LINES + 1) if str(d) != meta["answer"]])


def reject_repeat(pool: Pool, rng: random.Random, meta: dict[str, Any]) -> str:
    """A plausible but wrong copy: a line dropped, two lines swapped, a word replaced, or a
    line cut short. Only speech lines are touched, so the "NAME:" headers stay well-formed."""
    # The passage is "NAME:\nline..." groups joined by blank lines; (group, line) addresses
    # a speech line (line >= 1 skips the header).
    groups = [g.split("\n") for g in meta["answer"].split("\n\n")]
    where = [(g, k) for g, lines in enumerate(groups) for k in range(1, len(lines))]
    ops = ["replace_word", "truncate"] + (["drop", "swap"] if len(where) >= 2 else [])
    op = rng.choice(ops)
    g, k = rng.choice(where)
    words = groups[g][k].split(" ")
    if op == "drop":
        del groups[g][k]
    elif op == "swap":
        (g1, k1), (g2, k2) = rng.sample(where, 2)
        groups[g1][k1], groups[g2][k2] = groups[g2][k2], groups[g1][k1]
    elif op == "truncate" and len(words) >= 2:  # keep a strict, non-empty prefix of the words
        groups[g][k] = " ".join(words[: rng.randrange(1, len(words))])
    else:  # replace_word (also for one-word lines, which cannot be truncated)
        j = rng.randrange(len(words))
        words[j] = rng.choice([w for w in pool.corpus.vocab[:50] if w != words[j]])
        groups[g][k] = " ".join(words)
    return "\n\n".join("\n".join(lines) for lines in groups)


def reject_continuation(pool: Pool, rng: random.Random, meta: dict[str, Any]) -> str:
    """The same number of lines, taken from a different speech of the pool."""
    n = len(meta["answer"].split("\n"))
    tries = rng.sample(pool.multi_line, min(8, len(pool.multi_line)))
    other = rng.choice([s for s in tries if s.idx not in meta["speech_ids"]] or tries)
    start = rng.randrange(max(1, len(other.lines) - n + 1))
    return "\n".join(other.lines[start : start + n])


# -----------------------------------------------------------------------------
# the task table


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "short" | "long"
    make: Callable[[Pool, random.Random, int], TaskOutput]
    check: Callable[[dict[str, Any], str], float]
    reject: Callable[[Pool, random.Random, dict[str, Any]], str]


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("first_speaker", "short", make_first_speaker, check_exact, reject_speaker),
        Task("mentions_word", "short", make_mentions_word, check_exact, reject_yes_no),
        Task("line_count", "short", make_line_count, check_exact, reject_digit),
        Task("repeat", "long", make_repeat, check_repeat, reject_repeat),
        Task("continue_speech", "long", make_continue_speech, check_f1, reject_continuation),
    ]
}
SHORT_TASKS = [t for t in TASKS if TASKS[t].kind == "short"]
LONG_TASKS = [t for t in TASKS if TASKS[t].kind == "long"]


def score(task: str, metadata: dict[str, Any], response: Any) -> float:
    """Ground-truth score of `response` in [0, 1]. Raises only for an unknown task or
    malformed metadata (programming errors), never because of the response text."""
    if task not in TASKS:
        raise ValueError(f"unknown demo task {task!r}; known: {sorted(TASKS)}")
    if isinstance(response, bytes):
        response = response.decode("utf-8", errors="replace")
    if not isinstance(response, str):
        return 0.0
    return min(1.0, max(0.0, float(TASKS[task].check(metadata, response))))


def score_example(record: dict[str, Any], response: Any) -> float:
    """score() for a record from train/val/prompts/pairs.jsonl."""
    return score(record["task"], record["meta"], response)


# -----------------------------------------------------------------------------
# building records


def _task_counts(n: int, short_share: float) -> list[tuple[str, int]]:
    """Exact counts: round(n * short_share) short examples spread evenly over the short
    tasks (remainder to the first ones), the rest evenly over the long tasks."""
    if not 0.0 <= short_share <= 1.0:
        raise ValueError(f"short_share must be in [0, 1], got {short_share}")
    n_short = round(n * short_share)
    counts = []
    for names, total in ((SHORT_TASKS, n_short), (LONG_TASKS, n - n_short)):
        q, r = divmod(total, len(names))
        counts += [(name, q + (k < r)) for k, name in enumerate(names)]
    return counts


def _record(task: Task, prompt: str, answer: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
        "task": task.name,
        "kind": task.kind,
        "answer": answer,
        "meta": meta,
    }


def _build(pool: Pool, n: int, rng: random.Random, short_share: float) -> list[dict[str, Any]]:
    records = []
    for name, count in _task_counts(n, short_share):
        task = TASKS[name]
        for i in range(count):
            prompt, answer, meta = task.make(pool, rng, i)
            if score(name, meta, answer) != 1.0:  # the reference must be perfect by its own checker
                raise AssertionError(f"{name}: reference answer does not score 1.0: {answer!r}")
            records.append(_record(task, prompt, answer, meta))
    rng.shuffle(records)  # interleave tasks; mentions_word's yes/no alternation disappears
    return records


def build_examples(
    n: int,
    *,
    seed: int,
    corpus_path: str | Path = DEFAULT_CORPUS,
    short_share: float = 0.3,
    split: str = "all",
) -> list[dict[str, Any]]:
    """n chat records ({"messages", "task", "kind", "answer", "meta"}), deterministic in
    (n, seed, corpus, short_share, split). split: "all", or "train"/"val" (disjoint speeches)."""
    pool = load_corpus(corpus_path).pool(split)
    return _build(pool, n, random.Random(f"demo-examples:{split}:{seed}"), short_share)


def build_pairs(
    n: int,
    *,
    seed: int,
    corpus_path: str | Path = DEFAULT_CORPUS,
    short_share: float = 0.3,
    split: str = "train",
) -> list[dict[str, Any]]:
    """n preference pairs {"prompt": [user turn], "chosen", "rejected", "task", "kind", "meta"}.
    chosen is the reference answer, rejected a rule-made wrong answer with a strictly lower
    ground-truth score (checked here, so a reward model is trained on true labels)."""
    pool = load_corpus(corpus_path).pool(split)
    rng = random.Random(f"demo-pairs:{split}:{seed}")  # own stream: pair prompts differ from SFT's
    pairs = []
    for record in _build(pool, n, rng, short_share):
        chosen, task = record["answer"], TASKS[record["task"]]
        for _ in range(100):
            rejected = task.reject(pool, rng, record["meta"])
            # ground truth decides the label: the wrong answer must score strictly lower
            if rejected != chosen and score_example(record, rejected) < score_example(record, chosen):
                break
        else:
            raise AssertionError(f"{task.name}: no wrong answer scoring below {chosen!r}")
        pairs.append(
            {
                "prompt": record["messages"][:1],
                "chosen": chosen,
                "rejected": rejected,
                "task": task.name,
                "kind": task.kind,
                "meta": record["meta"],
            }
        )
    return pairs


def prompt_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records without the assistant turn: what PPO generates from."""
    return [{**r, "messages": [m for m in r["messages"] if m["role"] != "assistant"]} for r in records]


# -----------------------------------------------------------------------------
# files


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


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonl(records: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


DATA_FILES = {"train": "train.jsonl", "val": "val.jsonl", "prompts": "prompts.jsonl", "pairs": "pairs.jsonl"}
MANIFEST = "demo_manifest.json"


def write_demo_dataset(
    out_dir: str | Path,
    *,
    n_train: int = 4000,
    n_val: int = 400,
    n_pairs: int = 2000,
    seed: int = 0,
    corpus_path: str | Path = DEFAULT_CORPUS,
) -> dict[str, Path]:
    """Write train/val/prompts/pairs.jsonl + demo_manifest.json under out_dir and return
    their paths ({"train", "val", "prompts", "pairs", "manifest"}). A no-op when all files
    exist and the manifest records the same parameters."""
    check_demo_arguments(out_dir, n_train=n_train, n_val=n_val, n_pairs=n_pairs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {key: out / name for key, name in DATA_FILES.items()}
    paths["manifest"] = out / MANIFEST
    corpus_file = Path(corpus_path)
    params = {
        "format": FORMAT_VERSION,
        "n_train": n_train,
        "n_val": n_val,
        "n_pairs": n_pairs,
        "seed": seed,
        "corpus_sha256": hashlib.sha256(corpus_file.read_bytes()).hexdigest(),
        # first_speaker's name pool depends on the default tokenizer
        "tokenizer": _default_tokenizer().fingerprint,
    }
    if all(p.exists() for p in paths.values()):
        try:
            if json.loads(paths["manifest"].read_text(encoding="utf-8")) == params:
                return paths
        except (OSError, ValueError):
            pass  # unreadable manifest: rebuild

    train = build_examples(n_train, seed=seed, corpus_path=corpus_file, split="train")
    val = build_examples(n_val, seed=seed, corpus_path=corpus_file, split="val")
    pairs = build_pairs(n_pairs, seed=seed, corpus_path=corpus_file, split="train")
    # Manifest goes first and comes back last: an interrupted rewrite leaves no manifest,
    # so the next call rebuilds instead of trusting a mix of old and new files.
    paths["manifest"].unlink(missing_ok=True)
    for key, records in (("train", train), ("val", val), ("prompts", prompt_records(val)), ("pairs", pairs)):
        _atomic_write(paths[key], _jsonl(records))
    _atomic_write(paths["manifest"], json.dumps(params, indent=2) + "\n")
    return paths


# -----------------------------------------------------------------------------
# statistics + CLI


def answer_tokens(records: Iterable[dict[str, Any]], tokenizer=None) -> list[tuple[str, str, int]]:
    """(task, kind, supervised tokens) per record: the answer's tokens (stripped, as
    encode_chat does) + 1 for <|eot_id|>."""
    tok = tokenizer or _default_tokenizer()
    return [(r["task"], r["kind"], len(tok.encode(r["answer"].strip())) + 1) for r in records]


def short_token_share(records: Iterable[dict[str, Any]], tokenizer=None) -> float:
    counts = answer_tokens(records, tokenizer)
    total = sum(n for _, _, n in counts)
    return sum(n for _, kind, n in counts if kind == "short") / total if total else 0.0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.demo_tasks", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--n-val", type=int, default=400)
    parser.add_argument("--n-pairs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    args = parser.parse_args(argv)

    paths = write_demo_dataset(
        args.out_dir,
        n_train=args.n_train,
        n_val=args.n_val,
        n_pairs=args.n_pairs,
        seed=args.seed,
        corpus_path=args.corpus,
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
