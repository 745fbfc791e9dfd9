"""The end-to-end pipeline (prepare → pretrain → SFT → RM → PPO, GRPO, DPO, rejection sampling → report) on the
tiny preset: what it leaves
behind, incremental re-runs (skip, changed config, interrupted stage) and starting from a given checkpoint.

The full run happens once per module (about a minute on 2 cores); the other slow tests build on its folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from alignment.commands.pipeline import Pipeline, load_pipeline_config, run_pipeline
from alignment.commands.pipeline_records import RECORD
from data.demo.tasks import load_jsonl
from models import load_checkpoint
from models.errors import ConfigError, DataError
from models.formats.checkpoint import save_checkpoint
from models.heads import load_scalar_model
from models.model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs" / "pipeline" / "tiny.yaml")
MODEL_STAGES = ("pretrain", "sft", "rm", "ppo", "grpo", "dpo", "rejection_sampling")
POLICIES = ("pretrain", "sft", "ppo", "grpo", "dpo", "rejection_sampling")  # every stage whose final/ is an LM
PROMPTS = 4  # report.prompts in tiny.yaml
# lm-eval tasks at each validation of every stage (two examples each) and in the report; reruns pass them too
CHOICE = "[lantern_demo_choice,lantern_demo_answers]"
HARNESS = [
    "pretrain.eval.harness_tasks=[lantern_demo_passages]",
    *(f"{s}.eval.harness_tasks={CHOICE}" for s in ("sft", "ppo", "grpo", "dpo", "rejection_sampling.sft")),
    *(f"{s}.eval.harness_limit=2" for s in ("pretrain", "sft", "ppo", "grpo", "dpo", "rejection_sampling.sft")),
    "report.harness_tasks=[lantern_demo_choice,lantern_demo_passages]",
    "report.harness_limit=4",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    """One full pipeline run; the presets name repository-relative files, so it runs from the repo root."""
    out = tmp_path_factory.mktemp("pipeline") / "tiny"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        start = time.perf_counter()
        returned = run_pipeline(TINY, [f"out_dir={out}", *HARNESS])
        seconds = time.perf_counter() - start
    finally:
        os.chdir(cwd)
    return {"out": out, "returned": returned, "seconds": seconds}


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)


def _statuses(caplog) -> dict[str, str]:
    """stage -> status from the pipeline's "STAGE: STATUS in Ns" log lines."""
    found = {}
    for record in caplog.records:
        match = re.match(r"(\w+): (ran|resumed|skipped: up to date) in ", record.getMessage())
        if record.name == "lantern.pipeline" and match:
            found[match.group(1)] = match.group(2)
    return found


def _mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def _table_rows(report: str) -> list[list[str]]:
    """Numbered rows of the answer table, split into cells."""
    return [
        [c.strip() for c in line.strip("|").split(" | ")]
        for line in report.splitlines()
        if re.match(r"\| \d+ \|", line)
    ]


def test_stage_list_is_checked_before_anything_runs(tmp_path, in_repo):
    for stages in ("[sft,pretrain]", "[pretrain,distill]", "[sft,sft]"):
        with pytest.raises(ConfigError, match="stages must be"):
            run_pipeline(TINY, [f"out_dir={tmp_path}", f"stages={stages}"])
    with pytest.raises(ConfigError, match="report"):
        run_pipeline(TINY, [f"out_dir={tmp_path}", "report.prompt=3"])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "configs" / "pipeline").glob("*.yaml")))
def test_every_shipped_pipeline_resolves_each_stage_config(preset, tmp_path, in_repo):
    """Every stage of every shipped pipeline loads with its overrides (a mistyped key or YAML quoting fails here, not
    minutes into a run); the default demo's RL stages are rewarded by the checker on the miscounted task alone. A
    preset that starts from a converted model (smollm2) is pointed at a stand-in folder: a clean checkout has none."""
    path = ROOT / "configs" / "pipeline" / f"{preset}.yaml"
    overrides = [f"out_dir={tmp_path}"]
    if OmegaConf.load(path).get("start_checkpoint"):
        (tmp_path / "start").mkdir()
        overrides.append(f"start_checkpoint={tmp_path / 'start'}")
    pipeline = Pipeline(load_pipeline_config(str(path), overrides))
    pipeline.write_demo()
    configs = {stage: pipeline.load_stage_config(stage)[0] for stage in pipeline.config.stages if stage != "prepare"}
    if preset == "default":
        assert pipeline.config.demo.line_count_miscount > 0.5  # most demonstrations wrong: SFT's greedy answer too
        train = [json.loads(line) for line in (pipeline.demo / "train.jsonl").read_text().splitlines()]
        miscounted = [r for r in train if r.get("miscounted")]
        line_count = [r for r in train if r["task"] == "line_count"]
        assert len(miscounted) == round(pipeline.config.demo.line_count_miscount * len(line_count))
        for stage in ("ppo", "grpo"):
            assert configs[stage].data.train_tasks == ["line_count"]
            assert [(t.kind, t.path) for t in configs[stage].reward.terms] == [
                ("checker", "data.demo.scoring:score_example")
            ]
        assert configs["ppo"].init.critic == "zeros"  # not a copy of the reward model, whose units the checker's aren't


def test_the_pipelines_peft_section_reaches_every_fine_tuning_stage_and_a_stages_own_wins(tmp_path, in_repo):
    """``peft.kind=lora`` on the pipeline puts adapters in SFT, the reward model, PPO, GRPO, DPO and rejection
    sampling (its SFT section), not in pretraining; ``rm.peft.rank=4`` overrides the pipeline's rank for that stage."""
    overrides = [f"out_dir={tmp_path}", "peft.kind=lora", "peft.rank=8", "rm.peft.rank=4"]
    pipeline = Pipeline(load_pipeline_config(TINY, overrides))
    pipeline.write_demo()
    sections = {}
    for stage in ("pretrain", "sft", "rm", "ppo", "grpo", "dpo", "rejection_sampling"):
        config = pipeline.load_stage_config(stage)[0]
        sections[stage] = config.sft.peft if stage == "rejection_sampling" else getattr(config, "peft", None)
    assert sections.pop("pretrain") is None
    assert {stage: (peft.kind, peft.rank) for stage, peft in sections.items()} == {
        "sft": ("lora", 8), "rm": ("lora", 4), "ppo": ("lora", 8), "grpo": ("lora", 8), "dpo": ("lora", 8),
        "rejection_sampling": ("lora", 8),
    }  # fmt: skip
    off = Pipeline(load_pipeline_config(TINY, [f"out_dir={tmp_path}"]))
    off.write_demo()
    assert off.load_stage_config("sft")[0].peft.kind == "none"


def test_align_from_start_starts_every_stage_after_sft_from_the_start_checkpoint(tmp_path, in_repo):
    """``align_from=start`` (a real instruct model's preset): PPO and GRPO start from start_checkpoint, SFT is a
    control from the same start, and the demo data are the arithmetic tasks; without a start_checkpoint it is one
    line."""
    with pytest.raises(ConfigError, match="align_from=start: the stages after SFT start from start_checkpoint"):
        Pipeline(load_pipeline_config(TINY, [f"out_dir={tmp_path}", "align_from=start"]))
    with pytest.raises(ConfigError, match=r"^start_checkpoint: no checkpoint folder at .*nope$"):
        Pipeline(load_pipeline_config(TINY, [f"out_dir={tmp_path}", f"start_checkpoint={tmp_path / 'nope'}"]))
    start = save_checkpoint(Transformer(ModelConfig.from_preset("tiny")), tmp_path / "start")
    overrides = [
        f"out_dir={tmp_path / 'p'}", "stages=[sft,ppo,grpo]", f"start_checkpoint={start}", "align_from=start",
        "demo.kind=arithmetic", "demo.arithmetic_tasks=[add,multiply]", "demo.n_train=40", "demo.n_val=20",
        "demo.n_pairs=10",
    ]  # fmt: skip
    pipeline = Pipeline(load_pipeline_config(TINY, overrides))
    pipeline.write_demo()
    assert str(pipeline.load_stage_config("sft")[0].init.checkpoint) == str(start)
    for stage in ("ppo", "grpo"):
        config, inputs = pipeline.load_stage_config(stage)
        assert str(config.init.policy) == str(start) and "start" in inputs and "sft" not in inputs
    prompts = load_jsonl(pipeline.demo / "prompts.jsonl")
    assert len(prompts) == 20 and {r["task"] for r in prompts} == {"add", "multiply"}


@pytest.mark.slow
def test_a_start_model_without_an_sft_stage_is_scored_once_as_the_base_and_sampled(tmp_path, in_repo):
    """``align_from=start`` with GRPO alone: the report scores the start model once (as the base, with samples, so
    that sampled gains have a baseline), not again as an SFT model, and pairs GRPO with it."""
    start = save_checkpoint(Transformer(ModelConfig.from_preset("tiny")), tmp_path / "start")
    overrides = [
        f"out_dir={tmp_path / 'p'}", "stages=[grpo]", f"start_checkpoint={start}", "align_from=start",
        "demo.kind=arithmetic", "demo.n_train=40", "demo.n_val=8", "demo.n_pairs=4",
    ]  # fmt: skip
    out = run_pipeline(TINY, overrides)
    assert sorted(p.name for p in (out / "report").glob("eval-*.json")) == ["eval-grpo.json", "eval-pretrain.json"]
    base = json.loads((out / "report" / "eval-pretrain.json").read_text())["result"]
    assert base["sampled"]["n"] == 4 and base["kl"] is None  # report.pass_k_prompts of tiny.yaml
    grpo = json.loads((out / "report.json").read_text())["stages"]["grpo"]
    assert grpo["vs_base"]["n"] == 8 and grpo["vs_base_sampled"]["n"] == 4 and "vs_sft" not in grpo
    assert grpo["kl"] is not None and "Against the start model, paired" in (out / "report.md").read_text()


def test_scoring_refuses_demo_data_written_with_other_settings(tmp_path, in_repo):
    """The scoring tools (score_sft) never rewrite a pipeline's demo data under its models: written with other
    demo.* settings than the config's, it is refused in one line naming the keys, and left as it was."""
    Pipeline(load_pipeline_config(TINY, [f"out_dir={tmp_path}"])).write_demo()
    demo = tmp_path / "data" / "demo"
    before = {p.name: p.read_bytes() for p in demo.iterdir()}
    other = Pipeline(load_pipeline_config(TINY, [f"out_dir={tmp_path}", "demo.seed=7", "demo.line_count_miscount=0.5"]))
    with pytest.raises(DataError, match=r"other settings \(line_count_miscount, seed\)"):
        other.write_demo(only_if_current=True)
    assert {p.name: p.read_bytes() for p in demo.iterdir()} == before
    Pipeline(load_pipeline_config(TINY, [f"out_dir={tmp_path}"])).write_demo(only_if_current=True)  # the same: fine
    (demo / "pairs.jsonl").unlink()  # the same settings with a file missing: rebuilt, not refused
    Pipeline(load_pipeline_config(TINY, [f"out_dir={tmp_path}"])).write_demo(only_if_current=True)
    assert {p.name: p.read_bytes() for p in demo.iterdir()} == before


@pytest.mark.slow
def test_full_run_leaves_report_plots_and_loadable_models(tiny_run):
    out = tiny_run["out"]
    assert tiny_run["returned"] == out
    report = (out / "report.md").read_text()
    for stage in ("prepare", *MODEL_STAGES):
        assert f"**{stage}**" in report
        assert (out / ("data" if stage == "prepare" else stage) / RECORD).is_file()
    for number in ("val/loss", "val/accuracy", "eval/gt_score", "eval/reward", "ppo/kl", "grpo/kl", "reward_accuracy"):
        assert number in report

    links = re.findall(r"!\[[^\]]*\]\((report/[^)]+\.png)\)", report)
    expected_plots = {"pretrain-loss", "sft-accuracy", "rm-accuracy", "ppo-eval", "grpo-eval", "dpo-accuracy"}
    assert "report/overview.png" in links and expected_plots <= {Path(p).stem for p in links}
    for link in links:
        data = (out / link).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024, link

    for stage in POLICIES:
        assert load_checkpoint(out / stage / "final").config.dim == 128
    _reward_model, metadata = load_scalar_model(out / "rm" / "final")
    assert metadata["stage"] == "rm" and "reward_std" in metadata

    # the wiring: each stage started from the previous stage's final/ and logged into one group
    sft, ppo = (out / "sft" / "config.yaml").read_text(), (out / "ppo" / "config.yaml").read_text()
    assert f"checkpoint: {out / 'pretrain' / 'final'}" in sft and "group: tiny" in sft
    assert f"policy: {out / 'sft' / 'final'}" in ppo and f"reward_model: {out / 'rm' / 'final'}" in ppo
    for stage in ("grpo", "dpo"):  # each alternative starts from the SFT model
        assert f"policy: {out / 'sft' / 'final'}" in (out / stage / "config.yaml").read_text()
    # rejection sampling's run folder holds the config of its fine-tuning, which starts from the SFT model too
    assert f"checkpoint: {out / 'sft' / 'final'}" in (out / "rejection_sampling" / "config.yaml").read_text()
    assert (out / "rejection_sampling" / "samples.jsonl").is_file()
    grpo = (out / "grpo" / "config.yaml").read_text()
    assert (
        str(out / "data" / "demo" / "train_prompts.jsonl") in grpo
        and str(out / "data" / "demo" / "prompts.jsonl") in grpo
    )

    # every stage held against its plan: the CPU plan's peak beside the memory in use the run measured, where
    # the process (which ran the stages before it) did not already hold more
    assert "## Each stage against its plan" in report
    for stage in MODEL_STAGES:
        plan = json.loads((out / "report.json").read_text())["stages"][stage]["plan"]
        assert plan["peak_bytes"] > 0 and plan["step_s"] is None, stage
        assert plan["measured_peak_bytes"] is None or plan["measured_peak_bytes"] > 0, stage

    rows = _table_rows(report)
    # #, task, prompt, reference + one answer per model
    assert len(rows) == PROMPTS and all(len(row) == 4 + len(POLICIES) for row in rows)
    assert "| model | greedy accuracy ± SE (n) | vs SFT, paired ± SE | sampled accuracy ± SE (n) |" in report
    assert "Per task, sampled (mean score of 2 samples at temperature 1 ± SE):" in report

    # report.json: the same numbers for other tools, every held-out prompt, one entry per stage
    results = json.loads((out / "report.json").read_text())["stages"]
    assert list(results) == list(MODEL_STAGES)
    for stage in POLICIES:
        heldout = results[stage]["heldout"]
        assert set(heldout) == {"accuracy", "se", "n", "per_task"} and heldout["n"] == 16  # demo n_val
        assert (
            0.0 <= heldout["accuracy"] <= 1.0 and heldout["se"] >= 0.0 and isinstance(results[stage]["seconds"], float)
        )
        assert (results[stage]["kl"] is None) == (stage in ("pretrain", "sft"))
        assert stage == "sft" or results[stage]["vs_sft"]["verdict"] in ("gain", "loss", "no clear difference")
        if stage != "pretrain":  # sampled: the mean score of the pass@k samples, paired with SFT's like greedy
            sampled = results[stage]["sampled"]
            assert sampled["samples"] == 2 and sampled["n"] == results[stage]["pass_at_k"]["n"]
            assert 0.0 <= sampled["accuracy"] <= 1.0 and sampled["se"] >= 0.0
            assert stage == "sft" or results[stage]["vs_sft_sampled"]["n"] == sampled["n"]
    assert results["rm"]["heldout"] is None  # not a policy: its own measure is pairwise accuracy
    assert results["sft"]["pass_at_k"]["k"] == 2


@pytest.mark.slow
def test_every_stage_scores_its_harness_tasks_and_the_report_every_model(tiny_run):
    """In-loop lm-eval tasks at each validation (RL: each held-out evaluation, the first before any update), logged
    with the stage's other numbers; the report scores every model on report.harness_tasks."""
    out = tiny_run["out"]
    steps = {"pretrain": [2, 4], "sft": [2], "ppo": [0, 2], "grpo": [0, 2], "dpo": [2], "rejection_sampling": [2]}
    for stage, expected in steps.items():
        assert [int(p.stem[5:]) for p in sorted((out / stage / "harness").glob("step-*.json"))] == expected, stage
        header = (out / stage / "csv" / "metrics.csv").read_text().splitlines()[0]
        name = "lantern_demo_passages/bits_per_byte" if stage == "pretrain" else "lantern_demo_choice/acc"
        prefix = "eval" if stage in ("ppo", "grpo") else "val"
        assert f"{prefix}/harness/{name}" in header.split(","), stage
        assert (out / "report" / f"{stage}-harness.png").is_file()
    report = (out / "report.md").read_text()
    assert (
        "| model | lantern_demo_choice/acc | lantern_demo_choice/acc_norm | lantern_demo_passages/word_perplexity"
        in report
    )
    results = json.loads((out / "report.json").read_text())["stages"]
    for stage in POLICIES:
        harness = results[stage]["harness"]
        assert 0.0 <= harness["lantern_demo_choice/acc"] <= 1.0 and harness["lantern_demo_passages/bits_per_byte"] > 0
        assert f"| {'base' if stage == 'pretrain' else stage} | " in report.split("## lm-evaluation-harness tasks")[1]
    assert "harness" not in results["rm"]


@pytest.mark.slow
def test_rerun_skips_then_a_changed_sft_setting_reruns_sft_rm_and_ppo(tiny_run, caplog, in_repo):
    out = tiny_run["out"]
    caplog.set_level(logging.INFO, logger="lantern.pipeline")
    before = {stage: _mtimes(out / stage) for stage in MODEL_STAGES}

    start = time.perf_counter()
    run_pipeline(TINY, [f"out_dir={out}", *HARNESS])
    assert time.perf_counter() - start < tiny_run["seconds"] / 2
    assert _statuses(caplog) == {stage: "skipped: up to date" for stage in ("prepare", *MODEL_STAGES)}
    assert {stage: _mtimes(out / stage) for stage in MODEL_STAGES} == before

    caplog.clear()
    run_pipeline(
        TINY, [f"out_dir={out}", *HARNESS, "sft.trainer.max_steps=3"]
    )  # appended to the preset's sft overrides
    assert _statuses(caplog) == {
        "prepare": "skipped: up to date",
        "pretrain": "skipped: up to date",
        **{stage: "ran" for stage in MODEL_STAGES[1:]},  # SFT and everything after it
    }
    assert _mtimes(out / "pretrain") == before["pretrain"]
    assert json.loads((out / "sft" / "final" / "lantern.json").read_text())["metadata"]["step"] == 3
    assert (out / "sft.previous" / "final").is_dir()  # the old run moved aside, not resumed from
    assert "**sft** (ran" in (out / "report.md").read_text()

    # interrupted: no record but a pending marker with the same hash → the stage resumes from its checkpoints
    (out / "ppo" / RECORD).rename(out / "ppo" / "pipeline_stage.pending.json")
    caplog.clear()
    run_pipeline(TINY, [f"out_dir={out}", *HARNESS, "sft.trainer.max_steps=3"])
    assert _statuses(caplog)["ppo"] == "resumed" and _statuses(caplog)["sft"] == "skipped: up to date"
    assert (out / "ppo" / RECORD).is_file() and not (out / "ppo" / "pipeline_stage.pending.json").exists()

    # interrupted after its last checkpoint but before the export: the resumed run has nothing left to train
    # and exports the model from that checkpoint
    (out / "ppo" / RECORD).rename(out / "ppo" / "pipeline_stage.pending.json")
    shutil.rmtree(out / "ppo" / "final")
    caplog.clear()
    run_pipeline(TINY, [f"out_dir={out}", *HARNESS, "sft.trainer.max_steps=3"])
    assert _statuses(caplog)["ppo"] == "resumed" and "exported no final model" not in caplog.text
    assert load_checkpoint(out / "ppo" / "final").config.dim == 128


@pytest.mark.slow
def test_alignment_stages_from_a_start_checkpoint(tiny_run, tmp_path, caplog, in_repo):
    caplog.set_level(logging.INFO, logger="lantern.pipeline")
    start = tiny_run["out"] / "pretrain" / "final"
    out = run_pipeline(TINY, [f"out_dir={tmp_path / 'aligned'}", "stages=[sft,rm,ppo]", f"start_checkpoint={start}"])
    assert _statuses(caplog) == {"sft": "ran", "rm": "ran", "ppo": "ran"}
    assert not (out / "pretrain").exists()
    assert f"checkpoint: {start}" in (out / "sft" / "config.yaml").read_text()
    report = (out / "report.md").read_text()
    assert "**sft**" in report and "**pretrain**" not in report
    rows = _table_rows(report)
    assert len(rows) == PROMPTS and all(len(row) == 4 + 3 for row in rows)  # base (the start checkpoint), SFT, PPO


def test_report_headline_lists_each_mixture_source():
    from alignment.commands.pipeline_report import expand, headline

    series = {
        "val/loss": [(10, 3.0), (20, 2.5)],
        "val/web/loss": [(10, 3.2), (20, 2.6)],
        "val/code/loss": [(10, 2.5), (20, 2.2)],
        "val/web/perplexity": [(10, 24.5), (20, 13.5)],
    }
    assert headline("pretrain", series) == (
        "val/loss 3.000 → 2.500; val/code/loss 2.500 → 2.200; val/web/loss 3.200 → 2.600"
    )
    assert headline("pretrain", {"val/loss": [(5, 4.0)]}) == "val/loss 4.000 → 4.000"  # one corpus: as before
    assert expand(["train/loss", "val/*/loss"], series) == ["train/loss", "val/code/loss", "val/web/loss"]


def test_the_report_plays_tool_episodes_and_shows_calls_malformed_calls_and_transcripts(tmp_path, in_repo, monkeypatch):
    """``report.episodes.environment``: every model answers in tool episodes. A scripted policy writes a malformed
    call, then a calculator call, then its answer; the report counts both calls per episode, keeps every transcript
    (the tool's error and result as the tool turns) and scores the final answer. A bad environment is refused first."""
    from alignment.commands import pipeline_eval

    # room for the system turn that describes the tools and three turns
    start = save_checkpoint(Transformer(ModelConfig.from_preset("tiny", max_seq_len=1024)), tmp_path / "start")
    common = [
        f"start_checkpoint={start}", "stages=[sft]", "report.episodes.max_tokens=1024", "demo.kind=arithmetic", "demo.n_train=40", "demo.n_val=6",
        "demo.n_pairs=4", "report.max_new_tokens=40",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="^report.episodes.environment: json:dumps is not an Environment"):
        run_pipeline(TINY, [f"out_dir={tmp_path / 'bad'}", *common, "report.episodes.environment=json:dumps"])
    assert not (tmp_path / "bad").exists()

    turns = ['<tool_call>{"name": "calculator", oops</tool_call>', CALL, "The answer is 42."]

    def scripted(model, tokenizer, generator=None, **sampling):
        def sample(rows, max_new_tokens):
            texts = [tokenizer.decode(row) for row in rows]
            done = [text.count("oops") + text.count("(6 * 7)") for text in texts]  # the turns written so far
            return [tokenizer.encode(turns[min(n, 2)]) + [tokenizer.eot_id] for n in done]

        return sample

    monkeypatch.setattr(pipeline_eval, "generate_sampler", scripted)
    environment = "report.episodes.environment=alignment.shared.episodes:Environment"
    out = run_pipeline(TINY, [f"out_dir={tmp_path / 'tools'}", *common, environment])
    stats = json.loads((out / "report.json").read_text())["stages"]["sft"]["episodes"]
    assert stats["turns"] == 3 and stats["tool_calls"] == 2 and stats["malformed_calls"] == 1
    assert stats["ended_answer"] == 1
    rows = [json.loads(line) for line in (out / "report" / "transcripts-sft.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(row["answer"] == "The answer is 42." and row["score"] is not None for row in rows)
    tail = rows[0]["messages"][-5:]
    assert [m["role"] for m in tail] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert tail[1]["content"].startswith("error:") and tail[3]["content"] == "42"
    report = (out / "report.md").read_text()
    assert re.search(r"\| sft \| 3\.00 \| 2\.00 \| 1\.00 \|", report) and re.search(r"\| base \| 3\.00 \|", report)
    assert "## Episodes on 3 of the held-out prompts" in report and "tool: 42" in report


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "(6 * 7)"}}</tool_call>'


def test_a_report_without_samples_has_no_sampled_columns():
    """``report.pass_k=0`` (greedy only, as the tool preset scores): no sampled or pass@k columns, no empty table."""
    from alignment.commands.pipeline_report import comparison_lines

    summary = {"accuracy": 0.5, "se": 0.1, "n": 10, "per_task": {"add": {"accuracy": 0.5, "se": 0.1, "n": 10}}}
    lines = comparison_lines({"sft": {"heldout": summary, "kl": None}}, {"sft": 3.0}, 0)
    assert lines[:3] == [
        "| model | greedy accuracy ± SE (n) | vs SFT, paired ± SE | KL to SFT (nats) | training s |",
        "|---|---|---|---|---|",
        "| sft | 0.500 ± 0.100 (10) | — | n/a | 3.0 |",
    ]
    assert not any("sampled" in line or "pass@" in line for line in lines)
