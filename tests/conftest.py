"""Fixtures the test modules share (plain helpers are in tests/helpers.py)."""

from __future__ import annotations

import pytest

from data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The bundled default tokenizer."""
    return Tokenizer.load("default")
