"""The GPU benchmark and check on their CPU paths: bench_pretrain's three contenders, gpu_table's table, and
gpu_check.sh's argument handling and (slow) its --cpu-smoke run of every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from alignment.commands.pipeline import run_pipeline
from alignment.schemas.pretrain import PretrainConfig
from benchmarks import alignment_compare, score_models
from benchmarks.bench_pretrain import recomputed_flops
from benchmarks.gpu_table import render
from tests.conftest import CORPUS
from tests.helpers import subprocess_env
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs/pretrain/tiny.yaml"), "--seq-len", "64", "--micro-batch", "4", "--threads", "1",
        "--peak-size", "256", "--peak-seconds", "0.02"]  # fmt: skip


def bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    env = subprocess_env()
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_pretrain", *TINY, *args, "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_pretrain_plain_loop_trains_exactly_what_lightning_trains(tmp_path):
    """Same seed, batches, optimizer and schedule: the plain loop's loss after 3 steps equals the Lightning
    path's, so the comparison times the same work; the HF model has Lantern's parameter count (checked in the
    script) and its own initialisation, so only its loss differs."""
    data = bench(
        tmp_path, "--steps", "2", "--warmup", "1", "--precision", "32-true", "--data-dir", str(tmp_path / "data")
    )
    assert data["compile"] is False  # tiny.yaml's `auto` on CPU: every contender eager, as Lightning runs it
    results = {r["contender"]: r for r in data["results"]}
    assert list(results) == ["lightning", "plain", "hf"]
    assert results["plain"]["loss"] == pytest.approx(results["lightning"]["loss"], abs=1e-5)
    assert results["hf"]["loss"] != pytest.approx(results["lightning"]["loss"], abs=1e-3)
    assert results["lightning"]["document_masking"] and not results["hf"]["document_masking"]
    for r in results.values():
        assert r["tokens_per_second"] > 0 and r["mfu"] > 0 and r["peak_memory_gib"] is None  # no CUDA memory on CPU
        assert r["mfu"] == pytest.approx(r["tokens_per_second"] * data["flops_per_token"] / r["peak_flops"])
    assert results["hf"]["vs_hf"] == 1.0
    assert results["plain"]["vs_hf"] == pytest.approx(
        results["plain"]["tokens_per_second"] / results["hf"]["tokens_per_second"]
    )


def test_recomputed_flops_are_one_more_forward_of_the_checkpointed_blocks():
    config = load_config(PretrainConfig, ROOT / "configs/pretrain/tiny.yaml", ["trainer.activation_checkpointing=full"])
    model, seq_len = config.model, config.loader.seq_len
    head = model.vocab_size * model.dim  # the LM head: never checkpointed
    norms = model.n_layers * 2 * model.dim + model.dim  # counted in num_params, no matmul
    blocks_training = model.flops_per_token(seq_len) - 6 * (head + norms)  # 6 x block weights + 12·L·d·T
    assert recomputed_flops(config) == pytest.approx(blocks_training / 3)  # forward = a third of fwd + bwd
    config.trainer.activation_checkpointing, config.trainer.ac_every = "selective", 2
    assert recomputed_flops(config) == pytest.approx(blocks_training / 3 / 2)  # blocks 0, 2 of 4


def test_gpu_table_reads_every_result(tmp_path):
    (tmp_path / "env.json").write_text(
        json.dumps(
            {
                "date": "2026-11-23 06:00 UTC",
                "gpu": "NVIDIA H100 80GB HBM3",
                "torch": "2.11.0",
                "cuda": "13.0",
                "mode": "gpu",
                "commit": "abc1234",
            }
        )
    )
    (tmp_path / "steps.tsv").write_text(
        "install\t0\t12\tlog: install.log\ntests\t1\t300\tlog: tests.log\npipeline\t124\t5400\tlog: pipeline.log\npretrain\t0\t250\tlog: pretrain.log\ngeneration\tskip\t\tnot in --steps\n"
    )
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite tests="10" failures="1" errors="1" skipped="3"/></testsuites>'
    )
    results = [
        {"contender": "lightning", "precision": "bf16-mixed", "document_masking": True, "tokens_per_second": 61234.5, "mfu": 0.4612, "peak_memory_gib": 41.25, "vs_hf": 1.153, "peak_flops": 989e12},
        {"contender": "hf", "precision": "bf16-mixed", "document_masking": False, "tokens_per_second": 53100.0, "mfu": 0.40, "peak_memory_gib": 50.0, "vs_hf": 1.0, "peak_flops": 989e12},
    ]  # fmt: skip
    (tmp_path / "pretrain-1b.json").write_text(
        json.dumps(
            {"mode": "compare", "preset": "llama3.2-1b-1gpu", "seq_len": 2048, "micro_batch": 4, "results": results}
        )
    )
    three_b = {
        "contender": "lightning",
        "precision": "bf16-mixed",
        "document_masking": True,
        "tokens_per_second": 20000.0,
        "mfu": 0.36,
        "hfu_with_recomputation": 0.47,
        "peak_memory_gib": 60.5,
        "vs_hf": None,
        "peak_flops": 989e12,
    }
    (tmp_path / "pretrain-3b.json").write_text(
        json.dumps(
            {"mode": "fsdp-ac", "preset": "llama3.2-3b", "seq_len": 2048, "micro_batch": 4, "results": [three_b]}
        )
    )
    generation = [{"batch": 1, "mode": "eager", "tokens_per_second": 150.0, "speedup_vs_eager": 1.0},
                  {"batch": 64, "mode": "compiled", "tokens_per_second": 7000.25, "speedup_vs_eager": 3.5, "peak_memory_gib": 9.0}]  # fmt: skip
    (tmp_path / "generation.json").write_text(
        json.dumps({"preset": "llama3.2-1b", "dtype": "bfloat16", "results": generation})
    )

    table = render(tmp_path)
    lines = table.splitlines()
    assert "## GPU check: 2026-11-23 06:00 UTC" in lines and any("NVIDIA H100 80GB HBM3" in line for line in lines)
    assert "| install | ok | 12 s | log: install.log |" in lines
    assert "| tests | FAILED (exit 1) | 300 s | 5 passed, 2 failed, 3 skipped |" in lines
    assert "| pipeline | FAILED (exit 124) | 5400 s | log: pipeline.log |" in lines
    assert "| generation | skipped | – | not in --steps |" in lines
    assert (
        "| pretrain llama3.2-1b-1gpu seq 2048 x 4: lightning (bf16-mixed, doc mask) | 46.1% | 61,234 | 41.2 | vs HF 1.15x |"
        in lines
    )
    assert "| pretrain llama3.2-1b-1gpu seq 2048 x 4: hf (bf16-mixed, causal) | 40.0% | 53,100 | 50.0 |  |" in lines
    assert (
        "| pretrain llama3.2-3b seq 2048 x 4, FSDP2 + AC: lightning (bf16-mixed, doc mask) | 36.0% (HFU 47.0%) | 20,000 | 60.5 |  |"
        in lines
    )
    assert "| generation llama3.2-1b bfloat16 batch 1 eager |  | 150.0 | – | 1.00x vs eager |" in lines
    assert "| generation llama3.2-1b bfloat16 batch 64 compiled |  | 7,000.2 | 9.0 | 3.50x vs eager |" in lines
    assert "(989 TFLOP/s)" in table


def test_gpu_table_survives_missing_and_broken_files(tmp_path):
    (tmp_path / "pretrain-1b.json").write_text("{not json")
    table = render(tmp_path)
    assert "(no steps.tsv)" in table and "pretrain-1b.json: " in table


def test_gpu_check_arguments():
    script = str(ROOT / "benchmarks/gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    helped = subprocess.run(["bash", script, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "pip download --no-deps -d .whl" in helped.stdout
    wrong = subprocess.run(["bash", script, "--steps", "tests,benchmark"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "unknown step 'benchmark'" in wrong.stderr


@pytest.mark.slow
def test_gpu_check_cpu_smoke_runs_every_step(tmp_path):
    """The whole check on CPU with tiny sizes, in this test's environment (--no-install): every step passes and
    the table holds the benchmarks' numbers."""
    steps = "tests,pipeline,pretrain,pretrain-3b,generation"
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--cpu-smoke", "--no-install", "--venv", sys.prefix,
         "--out", str(tmp_path), "--steps", steps],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    table = (tmp_path / "table.md").read_text()
    for step in ["install", *steps.split(",")]:
        assert f"| {step} | ok |" in table
    assert "lightning (32-true, doc mask)" in table and "FSDP2 + AC: lightning (bf16-mixed" in table
    assert "| generation tiny float32 batch 4 static |" in table


BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")
# one fresh process for all of them (a process each cost ~4 s of imports apiece): each module runs as __main__ with
# --help, exactly as `python -m benchmarks.NAME --help` does, and prints its name and its usage line's status
HELP_EACH = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
        code = "returned"
    except SystemExit as stop:
        code = stop.code
    print(name, code, "usage:" in out.getvalue())
"""


def test_every_benchmark_runs_as_a_module_of_the_installed_project():
    """`python -m benchmarks.NAME --help` from the repository root: the imports resolve without sys.path edits, and
    each prints its usage and exits 0."""
    done = subprocess.run([sys.executable, "-c", HELP_EACH, *BENCHMARKS], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"{name} 0 True" for name in BENCHMARKS], done.stderr[-2000:]


def test_reading_path_follows_a_command_from_the_cli_to_its_first_optimizer_step(data_dir, tmp_path):
    command = ["pretrain", str(ROOT / "configs/pretrain/tiny.yaml"), f"data.source=[{CORPUS}]", f"data.out_dir={data_dir}",
               f"run.out_dir={tmp_path / 'runs'}", "trainer.max_steps=2", "loader.micro_batch_size=2", "sample.prompt="]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "benchmarks.reading_path", "--out", str(tmp_path), *command], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = json.loads((tmp_path / "reading_path.json").read_text())
    assert path["alignment/commands/cli.py"][0] == "main"
    assert "run_pretrain" in path["alignment/stages/pretrain.py"]
    assert "LanguageModelModule.configure_optimizers" in path["trainer/lm_module.py"]
    assert "PretrainModule.training_step" in path["alignment/stages/pretrain.py"]
    assert all(file.split("/")[0] in ("models", "data", "trainer", "alignment") for file in path)
    # a package __getattr__ the import system asks during a module body (from models import fast_decode) is import
    assert "models/__init__.py" not in path
    # traced up to the first step only: nothing after it ran under the trace (the step's checkpoint, step 2)
    assert "AtomicCheckpoint.save" not in path.get("trainer/storage.py", [])
    assert done.stdout.strip().endswith(f"{len(path)} files, {sum(map(len, path.values()))} functions")


@pytest.mark.slow
def test_alignment_compare_runs_every_method_from_one_sft_model(tmp_path, monkeypatch):
    """The benchmark on the tiny pipeline: each method trains from the same SFT model on its budget and is scored
    on the same held-out prompts, with KL to SFT; the table, JSON and PNG are written."""
    monkeypatch.chdir(ROOT)
    config = str(ROOT / "configs/pipeline/tiny.yaml")
    pipeline = run_pipeline(config, [f"out_dir={tmp_path / 'p'}", "stages=[prepare,pretrain,sft,rm]"])
    arguments = ["--pipeline", str(pipeline), "--config", config, "--samples", "8", "--out", str(tmp_path / "c")]
    alignment_compare.main([*arguments, "dpo.loader.micro_batch_size=2"])  # 2 pairs a step: 4 responses
    summary = json.loads((tmp_path / "c" / "alignment_compare.json").read_text())
    assert list(summary["methods"]) == ["sft", *alignment_compare.METHODS]
    assert summary["budgets"] == {"ppo": 8, "grpo": 8, "rloo": 8, "dpo": 8, "rejection_sampling": 8}
    for name, result in summary["methods"].items():
        assert result["heldout"]["n"] == 16 and (result["kl"] is None) == (name == "sft")
        assert name == "sft" or result["vs_sft"]["verdict"] in ("gain", "loss", "no clear difference")
    assert "rloo" in (tmp_path / "c" / "alignment_compare.md").read_text()
    assert (tmp_path / "c" / "alignment_compare.png").read_bytes()[:4] == b"\x89PNG"

    # a model made outside the pipeline, scored exactly as the report scores the pipeline's own
    grpo = tmp_path / "c" / "grpo" / "final"
    score_models.main(["--pipeline", str(pipeline), "--config", config, "--out", str(tmp_path / "s"), f"g={grpo}"])
    scored = json.loads((tmp_path / "s" / "score_models.json").read_text())["results"]
    assert scored["g"]["heldout"] == summary["methods"]["grpo"]["heldout"]  # the same prompts, checker and seeds
    assert scored["g"]["vs_sft_sampled"]["n"] == scored["sft"]["sampled"]["n"] == 4  # tiny: pass_k_prompts 4
    assert "scores" not in scored["g"] and "sampled accuracy" in (tmp_path / "s" / "score_models.md").read_text()
    # an override the pipeline ran with reaches the scoring's config
    score_models.main([
        "--pipeline", str(pipeline), "--config", config, "--set", "report.pass_k_prompts=2", "--out", str(tmp_path / "s2"),
        f"g={grpo}",
    ])  # fmt: skip
    scored = json.loads((tmp_path / "s2" / "score_models.json").read_text())["results"]
    assert scored["g"]["vs_sft_sampled"]["n"] == scored["sft"]["sampled"]["n"] == 2


@pytest.mark.parametrize(
    ("pairs", "message"),
    [(["g"], "expected NAME=PATH"), (["sft=x"], "used twice"), (["g=/nonexistent"], "not a model folder")],
)
def test_score_models_refuses_bad_model_arguments(pairs, message):
    with pytest.raises(SystemExit, match=message):
        score_models.named_models(pairs)


def test_score_models_needs_a_finished_sft_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    model = tmp_path / "m"
    model.mkdir()
    (model / "lantern.json").write_text("{}")
    arguments = ["--pipeline", str(tmp_path / "p"), "--config", "configs/pipeline/tiny.yaml", f"m={model}"]
    with pytest.raises(SystemExit, match="has no finished SFT stage"):
        score_models.main(arguments)


def test_plan_vs_published_rows_in_the_docs_are_what_the_planner_says_now():
    """docs/plan.md's table of published runs is kept by ``benchmarks.plan_vs_published --docs``: every run Lantern
    expresses is planned again here and its row must be in the docs as printed (a planner change that moves a figure
    fails until the table is rewritten)."""
    from benchmarks import plan_vs_published as pvp

    runs = [run for run in json.loads(pvp.RUNS.read_text()) if run["expresses"]]
    assert len(runs) >= 12
    block = pvp.DOCS.read_text().split(pvp.BEGIN, 1)[1].split(pvp.END, 1)[0]
    stale = [run["id"] for run in runs if pvp.row_line(run, pvp.compare(run)) not in block]
    assert not stale, f"rerun python -m benchmarks.plan_vs_published --docs: {stale}"
