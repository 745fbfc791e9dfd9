"""One parse of a GGUF file per call (``parsed_once``): gguf's ``GGUFReader`` parses every metadata field on opening,
the whole vocabulary included, and transformers' GGUF loader opens the file anew for the config, the weights and the
tokenizer. Measured on 2 cores: about 30 s a parse for Gemma 3 270M's 262,144 tokens, so a conversion that read it
four times spent most of its time there (docs/pretrained.md#gguf)."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

Function = TypeVar("Function", bound=Callable[..., Any])

_lock = threading.RLock()  # one block at a time: the reader is swapped on the gguf module, for every thread
_depth = 0


def parsed_once(function: Function) -> Function:
    """``function`` with every ``gguf.GGUFReader(path)`` opened for reading inside it, by Lantern or transformers,
    sharing one reader per file until it returns (nested calls share the outer call's readers)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _depth
        with _lock:
            if _depth:
                _depth += 1
                try:
                    return function(*args, **kwargs)
                finally:
                    _depth -= 1
            import gguf

            real = gguf.GGUFReader
            readers: dict[tuple[str, int, int], Any] = {}

            def shared_reader(path: str | os.PathLike, mode: str = "r") -> Any:
                if mode != "r":
                    return real(path, mode)
                stat = os.stat(path)
                key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
                if key not in readers:
                    readers[key] = real(path, mode)
                return readers[key]

            gguf.GGUFReader = shared_reader  # transformers imports it from the package at each call
            _depth = 1
            try:
                return function(*args, **kwargs)
            finally:
                _depth = 0
                gguf.GGUFReader = real

    return wrapper  # type: ignore[return-value]
