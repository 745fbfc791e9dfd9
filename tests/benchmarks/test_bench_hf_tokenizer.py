"""benchmarks/bench_hf_tokenizer.py at a tiny size (no timing is checked): every contender runs on the same
documents, prepare's tokens are each raw encoder's plus BOS/EOS, and the JSON holds the ratios and the load; and
bench_prepare's distinct corpus repeats no paragraph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_hf_tokenizer import MODES, PAIRS
from benchmarks.bench_prepare import corpus_digest, make_python_corpus
from data.tokenizer.convert import write_hf_tokenizer
from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def test_every_contender_runs_on_the_same_documents(tmp_path):
    folder = tmp_path / "tokenizer"  # the bundled tokenizer as a tokenizer.json: no GGUF conversion
    write_hf_tokenizer("default", folder)
    out = tmp_path / "result.json"
    args = ["--size-mb", "0.05", "--files", "2", "--repeats", "1", "--tokenizer-dir", str(folder), "--json", str(out)]
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_hf_tokenizer", *args], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["results"]
    assert list(rows) == MODES and set(result["goal_met"]) == set(PAIRS)
    for mode, raw_modes in PAIRS.items():
        assert rows[mode]["raw_baseline"] in raw_modes and rows[mode]["vs_raw"] > 0
        assert len(rows[mode]["vs_raw_per_round"]) == 1 and rows[mode]["extra_tokens"] == 0
    assert result["corpus"] == "python" and len(result["corpus_sha256"]) == 64
    assert len(result["load_average_start"]) == 3 and len(rows["prepare-hf"]["load_before"]) == 1


def test_the_python_corpus_is_distinct_paragraphs_of_the_size_asked(tmp_path):
    paths = make_python_corpus(tmp_path, 0.2, files=3)
    paragraphs = [p.strip("\n") for path in paths for p in path.read_text(encoding="utf-8").split("\n\n")]
    assert len(paths) == 3 and all(p.strip() for p in paragraphs)
    assert len(set(paragraphs)) == len(paragraphs)
    assert sum(path.stat().st_size for path in paths) >= 0.2e6
    (tmp_path / "again").mkdir()
    again = make_python_corpus(tmp_path / "again", 0.2, files=3)
    assert corpus_digest(again) == corpus_digest(paths)  # deterministic
