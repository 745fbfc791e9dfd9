"""The tokenizer files a checkpoint folder carries (a tiktoken ``tokenizer.model`` or Hugging Face's ``tokenizer.json``
with its companions), judged by file name and first bytes only: this layer imports no tokenizer library.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.errors import CheckpointError

RANK_FILE = "tokenizer.model"
# generation_config.json too: its eos_token_id list is part of the stop tokens
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

PathLike = str | os.PathLike
TokenizerFiles = Mapping[str, PathLike]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file as a dict; one ``CheckpointError`` naming the file when it is not one. Here, not in
    ``checkpoint_io`` (which re-exports it), so that loading a tokenizer imports no torch (``lantern prepare``)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def read_json_if_present(path: Path) -> dict[str, Any]:
    """A tokenizer folder's JSON file as a dict; {} when the folder has none (each is optional but tokenizer.json)."""
    return read_json(path) if path.is_file() else {}


def special_token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict ({"content": ...})."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_files_in(directory: Path) -> dict[str, Path]:
    """The tokenizer files of a checkpoint folder, by the name they take in a native folder."""
    files = {name: directory / name for name in HF_TOKENIZER_FILES if (directory / name).is_file()}
    for candidate in (directory / RANK_FILE, directory / "original" / RANK_FILE):
        if candidate.is_file() and is_tokenizer_json(candidate):  # a tokenizer.json saved under the rank file's name
            files.setdefault("tokenizer.json", candidate)
        elif candidate.is_file():
            files[RANK_FILE] = candidate
            break
    return files


def is_tokenizer_json(path: PathLike) -> bool:
    """Whether a tokenizer file is a Hugging Face tokenizer.json: by its name (``*.json``), else by its content (a
    JSON object; a tiktoken rank file starts with base64, a sentencepiece model with protobuf bytes)."""
    path = Path(path)
    if path.name.endswith(".json"):
        return True
    try:
        with open(path, "rb") as f:
            start = f.read(64)
    except OSError:
        return False
    return start.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")


def as_tokenizer_files(tokenizer: PathLike | TokenizerFiles | None) -> dict[str, Path]:
    """A tokenizer argument as files by name: a mapping is taken as it is (``Tokenizer.files``); one file by its
    kind: a tokenizer.json (``is_tokenizer_json``) with the companions beside it, as ``HFTokenizer.files`` gives
    them, else a rank file, ``tokenizer.model``. Every file must exist."""
    if tokenizer is None:
        return {}
    if isinstance(tokenizer, Mapping):
        files = {n: Path(p) for n, p in tokenizer.items()}
    elif Path(tokenizer).is_file() and is_tokenizer_json(tokenizer):
        # named by what it is, not by the argument's name: a tokenizer.json copied as tokenizer.model was later read
        # as a rank file ("binary content")
        path = Path(tokenizer)
        files = {name: path.parent / name for name in HF_TOKENIZER_FILES if (path.parent / name).is_file()}
        files["tokenizer.json"] = path
    else:
        files = {RANK_FILE: Path(tokenizer)}
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
    return files


def copy_tokenizer_files(files: Mapping[str, Path], directory: Path, *, rank_file_in_original: bool = False) -> None:
    """Copy ``files`` into ``directory``; a rank file goes to ``original/`` for a Hugging Face folder, as Meta's do."""
    for name, path in files.items():
        target = directory / name
        if name == RANK_FILE and rank_file_in_original:
            target = directory / "original" / name
            target.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, target)


def special_ids(files: Mapping[str, Path]) -> tuple[int | None, list[int] | None]:
    """(bos id, stop ids) the tokenizer files name, or None where they do not say. A tiktoken rank file's Llama 3
    layout wins over a tokenizer.json converted from it: it names every stop token."""
    if RANK_FILE in files:
        bos, stops = _rank_file_special_ids(files[RANK_FILE])
        if stops is not None:
            return bos, stops
    if "tokenizer.json" in files:
        return _hf_special_ids(files)
    return None, None


def _hf_special_ids(files: Mapping[str, Path]) -> tuple[int | None, list[int] | None]:
    try:
        vocab = read_json(Path(files["tokenizer.json"]))
        config = read_json(Path(files["tokenizer_config.json"])) if "tokenizer_config.json" in files else {}
    except (OSError, ValueError):  # read_json's CheckpointError is a ValueError
        return None, None
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens") or []}
    ids.update((vocab.get("model") or {}).get("vocab") or {})

    def id_of(name: str) -> int | None:
        token = special_token_string(config.get(name))
        return ids.get(token) if token is not None else None

    eos = id_of("eos_token")
    return id_of("bos_token"), ([eos] if eos is not None else None)


def _rank_file_special_ids(path: Path) -> tuple[int | None, list[int] | None]:
    """bos / stop ids of a Lantern / Llama 3 tiktoken rank file: its N ranks are followed by Meta's 256 specials,
    <|begin_of_text|> = N, <|end_of_text|> = N+1, <|eom_id|> = N+8, <|eot_id|> = N+9."""
    try:
        lines = [line for line in path.read_bytes().splitlines() if line.strip()]
        ranks = [int(line.split()[1]) for line in lines]
    except (OSError, ValueError, IndexError):
        return None, None  # not a rank file (e.g. a sentencepiece model): ids unknown
    if ranks != list(range(len(ranks))):
        return None, None
    n = len(ranks)
    return n, [n + 1, n + 8, n + 9]
