"""
The demo tasks themselves (listed in docstring): generators of (prompt, reference answer),
wrong-answer rules, and the record builders.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.demo.corpus import DEFAULT_CORPUS, Passage, Pool, load_corpus
from data.demo.scoring import score, score_example

MAX_PASSAGE_LINES = 4


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


def make_line_count(pool: Pool, rng: random.Random, i: int, max_lines: int = MAX_PASSAGE_LINES) -> TaskOutput:
    n = rng.randint(1, max_lines)
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
    top = max(MAX_PASSAGE_LINES, int(meta["answer"]))  # passages of up to 4 lines, or longer for line_count_max > 4
    return rng.choice([str(d) for d in range(1, top + 1) if str(d) != meta["answer"]])


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
    reject: Callable[[Pool, random.Random, dict[str, Any]], str]


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("first_speaker", "short", make_first_speaker, reject_speaker),
        Task("mentions_word", "short", make_mentions_word, reject_yes_no),
        Task("line_count", "short", make_line_count, reject_digit),
        Task("repeat", "long", make_repeat, reject_repeat),
        Task("continue_speech", "long", make_continue_speech, reject_continuation),
    ]
}
SHORT_TASKS = [t for t in TASKS if TASKS[t].kind == "short"]
LONG_TASKS = [t for t in TASKS if TASKS[t].kind == "long"]


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


def _build(
    pool: Pool, n: int, rng: random.Random, short_share: float, line_count_max: int = MAX_PASSAGE_LINES
) -> list[dict[str, Any]]:
    if not 1 <= line_count_max <= 9:  # one digit, as the prompt asks
        raise ValueError(f"line_count_max must be in [1, 9], got {line_count_max}")
    options = {"line_count": {"max_lines": line_count_max}}
    records = []
    for name, count in _task_counts(n, short_share):
        task = TASKS[name]
        for i in range(count):
            prompt, answer, meta = task.make(pool, rng, i, **options.get(name, {}))
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
    line_count_max: int = MAX_PASSAGE_LINES,
) -> list[dict[str, Any]]:
    """n chat records ({"messages", "task", "kind", "answer", "meta"}), deterministic in
    (n, seed, corpus, short_share, split, line_count_max). split: "all", or "train"/"val" (disjoint speeches).
    line_count_max: the longest passage line_count asks about (4 by default, like every task's passages)."""
    pool = load_corpus(corpus_path).pool(split)
    return _build(pool, n, random.Random(f"demo-examples:{split}:{seed}"), short_share, line_count_max)


def build_pairs(
    n: int,
    *,
    seed: int,
    corpus_path: str | Path = DEFAULT_CORPUS,
    short_share: float = 0.3,
    split: str = "train",
    line_count_max: int = MAX_PASSAGE_LINES,
) -> list[dict[str, Any]]:
    """n preference pairs {"prompt": [user turn], "chosen", "rejected", "task", "kind", "meta"}.
    chosen is the reference answer, rejected a rule-made wrong answer with a strictly lower
    ground-truth score (checked here, so a reward model is trained on true labels)."""
    pool = load_corpus(corpus_path).pool(split)
    rng = random.Random(f"demo-pairs:{split}:{seed}")  # own stream: pair prompts differ from SFT's
    pairs = []
    for record in _build(pool, n, rng, short_share, line_count_max):
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


def check_line_count_miscount(share: float, line_count_max: int = MAX_PASSAGE_LINES) -> None:
    """A share in [0, 1], and room for one more line: a miscounted 9 would be "10", not the digit the prompt asks."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"line_count_miscount must be in [0, 1], got {share}")
    if share and line_count_max > 8:
        raise ValueError(
            f"line_count_miscount needs line_count_max <= 8 (one more is still a digit), got {line_count_max}"
        )


def miscount_line_counts(records: list[dict[str, Any]], share: float, *, seed: int) -> list[dict[str, Any]]:
    """Imperfect demonstrations: round(share * line_count records) of them, drawn with their own seeded stream,
    answer one line too many, as an annotator who counts the first speaker's "NAME:" header as a line would.
    Only the assistant turn changes (and "miscounted": true marks the record): the reference ("answer", meta),
    hence the checker, the preference pairs and the RL prompts, stays right. That is the gap RL with a verifiable
    reward exists for: the reward knows better than the demonstrations SFT imitated."""
    check_line_count_miscount(share)
    line_count = [k for k, r in enumerate(records) if r["task"] == "line_count"]
    chosen = set(random.Random(f"demo-miscount:{seed}").sample(line_count, round(share * len(line_count))))
    out = []
    for k, record in enumerate(records):
        if k in chosen:
            wrong = str(int(record["answer"]) + 1)
            messages = [m if m["role"] != "assistant" else {**m, "content": wrong} for m in record["messages"]]
            record = {**record, "messages": messages, "miscounted": True}
        out.append(record)
    return out


def prompt_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records without the assistant turn: what PPO generates from."""
    return [{**r, "messages": [m for m in r["messages"] if m["role"] != "assistant"]} for r in records]
