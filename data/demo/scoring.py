"""
Ground-truth scoring of the demo tasks: a checker per task, and score / score_example.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any


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


_NUMBER = re.compile(r"-?\d[\d,]*")


def check_last_number(meta: dict[str, Any], response: str) -> float:
    """1.0 when the last number in the reply is the right one (data/demo/arithmetic.py), else 0."""
    found = _NUMBER.findall(response)
    return float(bool(found) and found[-1].replace(",", "") == meta["answer"])


# -----------------------------------------------------------------------------
# scoring

CHECKS: dict[str, Callable[[dict[str, Any], str], float]] = {
    "first_speaker": check_exact,
    "mentions_word": check_exact,
    "line_count": check_exact,
    "repeat": check_repeat,
    "continue_speech": check_f1,
    **dict.fromkeys(("add", "add_small", "subtract", "multiply"), check_last_number),  # data/demo/arithmetic.py
}


def score(task: str, metadata: dict[str, Any], response: Any) -> float:
    """Ground-truth score of `response` in [0, 1]. Raises only for an unknown task or
    malformed metadata (programming errors), never because of the response text."""
    if task not in CHECKS:
        raise ValueError(f"unknown demo task {task!r}; known: {sorted(CHECKS)}")
    if isinstance(response, bytes):
        response = response.decode("utf-8", errors="replace")
    if not isinstance(response, str):
        return 0.0
    return min(1.0, max(0.0, float(CHECKS[task](metadata, response))))


def score_example(record: dict[str, Any], response: Any) -> float | None:
    """score() for a record from train/val/prompts/pairs.jsonl; None for a row that is not a demo task (no
    ``task`` and ``meta``): as a checker it judges only the demo's prompts."""
    if "task" not in record or "meta" not in record:
        return None
    return score(record["task"], record["meta"], response)
