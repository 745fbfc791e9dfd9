"""Checkers: the ground truth a stage measures answers against, named in the config, never known to the stage.

A checker is a plain function ``f(record, answer) -> float | None``: ``record`` is a prompt row as the data
files hold it (the demo's rows carry ``task`` and ``meta``), ``answer`` the decoded response; it returns a
score in [0, 1] (1: correct), or None when it cannot judge that record (which is then left out of the mean).

Configs name a checker by import path, ``"package.module:function"`` (the demo's is
``data.demo_scoring:score_example``), so that the demo is one checker among others and a user's own is one
line of YAML. Nothing is evaluated from the string: it is split at ':' and looked up with ``importlib``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from models.errors import ConfigError

Checker = Callable[[dict[str, Any], str], "float | None"]


def load_checker(path: str, key: str) -> Checker | None:
    """The function ``path`` ("module:function") names, or None for an empty path. Errors name ``key``."""
    if not path:
        return None
    module_name, _, function_name = path.partition(":")
    if not module_name or not function_name or not all(part.isidentifier() for part in module_name.split(".")):
        raise ConfigError(f"{key}: {path!r} is not an import path of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{key}: cannot import {module_name!r} ({error})") from error
    checker = getattr(module, function_name, None)
    if not callable(checker):
        raise ConfigError(f"{key}: {module_name!r} has no function {function_name!r}")
    return checker
