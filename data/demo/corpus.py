"""
The demo tasks' corpus: the bundled Shakespeare text parsed into speeches, split pools and passages.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from data.tokenizer.tokenizer import Tokenizer

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "tinyshakespeare.txt"

# The train/val split uses a FIXED seed, independent of the sampling seed: val speeches are
# the same for every seed, so "val is unseen" holds even when train and val come from
# different seeds.
SPLIT_SEED = "lantern-demo-split-v1"
SPLIT_BLOCK = 32  # consecutive speeches per split unit: passages never straddle the split
VAL_FRACTION = 0.1

MAX_SHORT_ANSWER_TOKENS = 2  # first_speaker only asks about names this short
VOCAB_SIZE = 300  # common corpus words used as "no" probes for mentions_word

_WORD_RE = re.compile(r"[a-z]+")


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
def default_tokenizer() -> Tokenizer:
    """The default tokenizer, loaded once: short-answer names and answer token counts are measured with it."""
    return Tokenizer.load("default")


class Corpus:
    """Parsed speeches plus corpus-wide tables the tasks sample from (all in a
    deterministic order: no set iteration, so output does not depend on PYTHONHASHSEED)."""

    def __init__(self, speeches: list[Speech]):
        if not speeches:
            raise ValueError("corpus has no speeches ('NAME:' header followed by lines)")
        self.speeches = speeches
        tok = default_tokenizer()
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
