"""Continued pretraining of SmolLM2-135M-Instruct on a domain (the bundled Shakespeare), alone and mixed with general
English (the Python documentation's reST sources from Debian's ``python3.11-doc``), scored before and after through
``lantern eval`` in held-out bits per byte on both: the domain's gain and the general text's forgetting
(docs/results.md#continued-pretraining-smollm2-135m-instruct).

    apt-get install python3-doc                                # the general corpus (PSF licence), not committed
    lantern convert --from gguf SmolLM2-135M-Instruct.Q4_1.gguf --to native runs/smollm2-135m-instruct
    python -m benchmarks.continued_pretraining [--steps 60] [--domain-weight 0.7] [--heldout 200]

Held-out text is never trained on: every 10th Shakespeare paragraph and every 10th documentation file (by a hash of
its path) are held out before either corpus is written. Each run is ``configs/pretrain/smollm2-continue.yaml`` (its
data section replaced) in its own process; each model is scored by ``lantern eval --log-samples`` on the same
documents, and the figures are computed from the per-document log-likelihoods: bits per byte = -Σ log2 p / Σ bytes,
changes paired over documents with the delta-method standard error of a ratio. Results go to
``benchmarks/results/continued_pretraining.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from models.files.atomic import write_atomically

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "pretrain" / "smollm2-continue.yaml"
DOMAIN = ROOT / "data" / "corpus" / "tinyshakespeare.txt"
GENERAL = Path("/usr/share/doc/python3.11/html/_sources")  # Debian's python3.11-doc (python3-doc depends on it)
TASKS = {"cp_domain": "domain", "cp_general": "general"}


def held_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 10 == 0


def paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in text.split("\n\n") if p.strip()]


def build_corpora(folder: Path, heldout: int) -> dict[str, Any]:
    """Training files and held-out JSON-lines for both corpora under ``folder``; what was written."""
    if not GENERAL.is_dir():
        raise SystemExit(f"{GENERAL} is missing: install Debian's python3-doc (apt-get install python3-doc)")
    folder.mkdir(parents=True, exist_ok=True)
    domain = paragraphs(DOMAIN.read_text(encoding="utf-8"))
    domain_train = [p for i, p in enumerate(domain) if i % 10]
    domain_eval = [p for i, p in enumerate(domain) if not i % 10][:heldout]
    files = sorted(GENERAL.rglob("*.rst.txt"))
    train_files = [f for f in files if not held_out(str(f.relative_to(GENERAL)))]
    eval_docs = [p for f in files if held_out(str(f.relative_to(GENERAL))) for p in paragraphs(f.read_text("utf-8"))]
    eval_docs = [p for p in eval_docs if len(p) >= 200][:heldout]  # prose, not one-line directives
    (folder / "domain.txt").write_text("\n\n".join(domain_train) + "\n", encoding="utf-8")
    (folder / "general.txt").write_text(
        "\n\n".join(f.read_text(encoding="utf-8") for f in train_files) + "\n", encoding="utf-8"
    )
    for name, docs in (("domain", domain_eval), ("general", eval_docs)):
        lines = "".join(json.dumps({"text": doc}) + "\n" for doc in docs)
        (folder / f"{name}-heldout.jsonl").write_text(lines, encoding="utf-8")
    tasks = folder / "tasks"
    tasks.mkdir(exist_ok=True)
    for task, name in TASKS.items():
        config = {
            "task": task, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str((folder / f"{name}-heldout.jsonl").resolve())}},
            "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False}],
        }  # fmt: skip
        (tasks / f"{task}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return {
        "domain": {"train_paragraphs": len(domain_train), "heldout_documents": len(domain_eval)},
        "general": {"source": str(GENERAL), "licence": "PSF (Debian package python3.11-doc)",
                    "train_files": len(train_files), "heldout_documents": len(eval_docs),
                    "train_bytes": (folder / "general.txt").stat().st_size},
    }  # fmt: skip


def lantern(*args: str) -> float:
    """``lantern ARGS`` in its own process (output streamed); its wall seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "alignment.commands.cli", *args], cwd=ROOT, env=env, check=True)
    return time.perf_counter() - start


def document_scores(out: Path) -> dict[str, list[tuple[float, int]]]:
    """Per task, each held-out document's (log-likelihood in nats, UTF-8 bytes) from lm-eval's samples files."""
    scores: dict[str, list[tuple[float, int]]] = {}
    for task in TASKS:
        (path,) = sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1:]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows.sort(key=lambda row: row["doc_id"])
        scores[task] = [(float(row["filtered_resps"][0]), len(row["doc"]["text"].encode())) for row in rows]
    return scores


def bits_per_byte(scores: list[tuple[float, int]]) -> float:
    return -sum(ll for ll, _ in scores) / (math.log(2) * sum(n for _, n in scores))


def paired_change(before: list[tuple[float, int]], after: list[tuple[float, int]]) -> dict[str, float]:
    """after - before in bits per byte over the same documents, with the delta-method SE of the ratio Σd / Σbytes."""
    bits = [-(a - b) / math.log(2) for (b, _), (a, _) in zip(before, after)]
    sizes = [n for _, n in before]
    change = sum(bits) / sum(sizes)
    residuals = [d - change * n for d, n in zip(bits, sizes)]
    count = len(bits)
    se = math.sqrt(count / (count - 1) * sum(r * r for r in residuals)) / sum(sizes)
    return {"change": change, "se": se}


def write_config(path: Path, data: dict[str, Any]) -> Path:
    config = yaml.safe_load(PRESET.read_text(encoding="utf-8"))
    config["data"] = {**config["data"], **data}
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint", default="runs/smollm2-135m-instruct", help="the model continued (init.checkpoint)"
    )
    parser.add_argument("--steps", type=int, default=40, help="trainer.max_steps of each run (the presets')")
    parser.add_argument("--domain-weight", type=float, default=0.7, help="the domain's share of the mixture")
    parser.add_argument("--heldout", type=int, default=200, help="held-out documents per corpus")
    parser.add_argument("--out-dir", default="runs/continued-pretraining")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "continued_pretraining.json"))
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for both runs (a smoke test's)")
    parser.add_argument("--scores-only", action="store_true", help="score the runs' final/ models where they exist")
    args = parser.parse_args(argv)
    out = Path(args.out_dir).absolute()
    result: dict[str, Any] = {"checkpoint": args.checkpoint, "steps": args.steps, "domain_weight": args.domain_weight}
    result["corpora"] = build_corpora(out / "corpora", args.heldout)
    corpora = out / "corpora"
    runs = {
        "domain_only": {"source": [str(corpora / "domain.txt")], "out_dir": str(out / "data" / "domain_only")},
        "mixture": {"source": [], "out_dir": str(out / "data" / "mixture"), "sources": [
            {"name": "shakespeare", "source": [str(corpora / "domain.txt")], "weight": args.domain_weight},
            {"name": "pydoc", "source": [str(corpora / "general.txt")], "weight": 1 - args.domain_weight},
        ]},
    }  # fmt: skip
    common = [f"init.checkpoint={args.checkpoint}", f"run.out_dir={out}", f"trainer.max_steps={args.steps}",
              "logger.kind=csv", "sample.prompt=", *args.extra]  # fmt: skip
    models = {"start": args.checkpoint}
    result["seconds"] = {}
    for name, data in runs.items():
        models[name] = str(out / name / "final")
        if args.scores_only and Path(models[name]).is_dir():
            continue  # trained by an earlier invocation that stopped while scoring
        config = write_config(out / f"{name}.yaml", data)
        lantern("prepare", str(config), *common, f"run.name={name}")
        result["seconds"][name] = round(lantern("pretrain", str(config), *common, f"run.name={name}"), 1)
    scores = {}
    for name, model in models.items():
        evaluated = out / "eval" / name
        lantern("eval", model, "--tasks", ",".join(TASKS), "--include-path", str(corpora / "tasks"),
                "--log-samples", "--out", str(evaluated))  # fmt: skip
        scores[name] = document_scores(evaluated)
    result["bits_per_byte"] = {
        name: {TASKS[t]: bits_per_byte(s) for t, s in by_task.items()} for name, by_task in scores.items()
    }
    result["change_from_start"] = {
        name: {TASKS[t]: paired_change(scores["start"][t], scores[name][t]) for t in TASKS} for name in runs
    }
    gain = {name: -result["change_from_start"][name]["domain"]["change"] for name in runs}
    forgetting = {name: result["change_from_start"][name]["general"]["change"] for name in runs}
    result["goals"] = {
        "mixture keeps >= 90% of the domain gain": gain["mixture"] >= 0.9 * gain["domain_only"],
        "domain gain kept by the mixture": gain["mixture"] / gain["domain_only"] if gain["domain_only"] else None,
        # forgetting <= 0 (general text got no worse) leaves nothing to halve: the goal holds when the mixture's is too
        "mixture forgets <= half of the domain-only run": forgetting["mixture"]
        <= max(0.0, 0.5 * forgetting["domain_only"]),
        "forgetting of the mixture / domain-only": (
            forgetting["mixture"] / forgetting["domain_only"] if forgetting["domain_only"] else None
        ),
    }
    write_atomically(Path(args.json), json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("bits_per_byte", "change_from_start", "goals")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
