"""Rejection sampling: the choice of the best samples on hand-made scores, the records it writes read back by
the SFT loader, a short run on a tiny random policy (and its resume), one-line config errors before any
compute, and a 2-process FSDP2 run through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from alignment.schemas.rejection_sampling import RejectionSamplingConfig
from alignment.shared import sampling
from alignment.stages import rejection_sampling
from alignment.stages.rejection_sampling import (
    SAMPLES,
    STATS,
    keep_best,
    pass_at_k,
    run_rejection_sampling,
    select_best,
)
from data.demo.tasks import write_demo_dataset
from data.sft.datamodule import build_sft_data
from data.sft.rows import SFTDataConfig
from data.tokenizer.tokenizer import Tokenizer
from models.config_checks import numeric_fields, range_of
from models.errors import ConfigError
from models.formats.checkpoint import load_checkpoint, save_checkpoint
from models.model import ModelConfig, Transformer
from tests.helpers import run_cli
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/rejection_sampling/tiny.yaml"
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=256)
# small enough for 2 CPU cores: 6 prompts x 2 samples of 8 tokens, 2 SFT steps
FAST = [
    "sampling.prompts=6", "sampling.samples_per_prompt=2", "sampling.response_max_tokens=8",
    "sampling.keep_truncated=true",  # a random policy almost never ends a turn within 8 tokens
    "data.max_prompt_tokens=64", "sft.trainer.max_steps=2", "sft.trainer.val_every_n_steps=2",
    "sft.checkpoint.every_n_steps=2", "sft.loader.micro_batch_size=1", "sft.eval.generations=2", "sft.logger.kind=none", "sft.trainer.accelerator=cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny random policy saved as SFT would save it, and the demo prompts."""
    root = tmp_path_factory.mktemp("rs")
    tokenizer = Tokenizer.load("default")
    torch.manual_seed(0)
    policy_dir = save_checkpoint(Transformer(ModelConfig(**TINY)), root / "sft", tokenizer_path=tokenizer.path)
    demo = write_demo_dataset(root / "demo", n_train=20, n_val=40, n_pairs=10, seed=0)
    return {"policy": policy_dir, "prompts": demo["prompts"], "val": demo["val"], "tokenizer": tokenizer}


def rs_config(setup, out_dir, *overrides) -> RejectionSamplingConfig:
    return load_config(RejectionSamplingConfig, CONFIG, [*inputs(setup, out_dir), *FAST, *overrides])


def inputs(setup, out_dir) -> list[str]:
    """The policy, the prompts, SFT's validation data (the demo's) and the output folder."""
    return [
        f"init.policy={setup['policy']}", f"data.train=[{setup['prompts']}]", f"sft.data.val=[{setup['val']}]",
        f"run.out_dir={out_dir}",
    ]  # fmt: skip


# ---- choosing the best ----


def test_select_best_takes_the_highest_then_the_shorter_then_the_first():
    scores = [0.5, 1.0, 1.0, None, 1.0, 0.2, math.nan]
    lengths = [3, 5, 4, 1, 4, 2, 1]
    assert select_best(scores, lengths, keep=1, min_score=None) == [2]  # 1.0 ties: the shorter, then the first
    assert select_best(scores, lengths, keep=4, min_score=None) == [2, 4, 1, 0]
    assert select_best(scores, lengths, keep=10, min_score=0.5) == [2, 4, 1, 0]  # never below min_score
    assert select_best(scores, lengths, keep=10, min_score=0.51) == [2, 4, 1]
    assert select_best(scores, lengths, keep=3, min_score=2.0) == []
    assert select_best([None, None], [1, 1], keep=1, min_score=None) == []  # nothing keepable
    assert select_best([-3.0, -1.0], [9, 9], keep=1, min_score=None) == [1]  # reward-model scores may be negative


def test_pass_at_k_uses_min_score_or_a_checkers_verdicts():
    assert pass_at_k([1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0, 0.0, 0.0], None) == 0.5  # 0/1 checker
    assert pass_at_k([0.7, 0.2], [0.7, 0.1, 0.2], 0.5) == 0.5
    assert pass_at_k([0.7, 0.2], [0.7, 0.1, 0.2], None) is None  # graded scores and no threshold: undefined


def test_kept_records_are_sft_records_the_sft_loader_reads(setup, tmp_path):
    config = rs_config(setup, tmp_path, "sampling.samples_per_prompt=4", "sampling.keep_per_prompt=2")
    config.sampling.keep_truncated = False
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say yes."}]
    prompts = [
        {"record": {"messages": user}, "where": "a.jsonl, row 1"},
        {"record": {"prompt": "Say no."}, "where": "a.jsonl, row 2"},
    ]

    def sample(answer, score, tokens=3, ended=True):
        return {"answer": answer, "score": score, "scores": {"check": score}, "tokens": tokens, "ended": ended}

    samples = [
        sample("yes", 1.0), sample("yes", 1.0), sample("Yes!", 1.0, tokens=4), sample("no", 0.0),  # dup. skipped
        sample("   ", 1.0), sample("no no", 1.0, ended=False), sample("nope", 0.5), sample("no", 0.5, tokens=2),
    ]  # fmt: skip
    records, stats = keep_best(config, prompts, samples)
    assert [r["messages"][-1]["content"] for r in records] == ["yes", "Yes!", "no", "nope"]
    assert [r["place"] for r in records] == [0, 1, 0, 1]
    assert records[0]["messages"][:2] == user and records[2]["messages"][0] == {"role": "user", "content": "Say no."}
    assert stats["kept"] == 4 and stats["prompts_kept"] == 2
    assert stats["mean_best_score"] == 1.0 and stats["mean_score"] == pytest.approx(6.0 / 8)
    assert stats["pass_at_k"] is None  # scores of 0.5 are not a checker's verdicts, and no min_score

    config.sampling.min_score = 0.75  # the second prompt's finished answers score 0.5: it keeps nothing
    records, stats = keep_best(config, prompts, samples)
    assert [r["messages"][-1]["content"] for r in records] == ["yes", "Yes!"] and stats["pass_at_k"] == 1.0

    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = build_sft_data(SFTDataConfig(train=[str(path)], val=[str(path)], seq_len=64), setup["tokenizer"])
    assert len(data.train_examples) == 2 and len(data.val_examples) == 2


# ---- runs ----


def test_run_writes_samples_and_final_and_resume_does_not_sample_again(setup, tmp_path, monkeypatch):
    run_dir = run_rejection_sampling(rs_config(setup, tmp_path))
    assert run_dir == tmp_path / "rejection-sampling-tiny"
    stats = json.loads((run_dir / STATS).read_text())
    records = [json.loads(line) for line in (run_dir / SAMPLES).read_text().splitlines()]
    assert stats["prompts"] == 6 and stats["samples"] == 12 and stats["kept"] == len(records) == 6
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"].strip() for r in records)
    assert stats["mean_best_score"] >= stats["mean_score"] and stats["wall_seconds"] > 0
    assert load_checkpoint(run_dir / "final").config.dim == 64

    def refuse(*args, **kwargs):
        raise AssertionError("sampled again")

    monkeypatch.setattr(rejection_sampling, "run_sampling", refuse)
    run_rejection_sampling(rs_config(setup, tmp_path, "sft.trainer.max_steps=3"))  # same samples: SFT resumes
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000003.ckpt"
    with pytest.raises(ConfigError, match="holds SFT checkpoints"):  # other samples would be trained on: refused
        run_rejection_sampling(rs_config(setup, tmp_path, "sampling.temperature=0.5"))


def test_lora_fine_tunes_adapters_only_on_the_policy_it_sampled_from(setup, tmp_path):
    """``sft.peft.kind=lora``: the best samples are fine-tuned on with adapters over init.policy; the checkpoint holds
    the adapters and a pointer to init.policy, and final/ is the plain model with them folded in."""
    run_dir = run_rejection_sampling(rs_config(setup, tmp_path, "sft.peft.kind=lora", "sft.peft.rank=4"))
    checkpoint = torch.load(run_dir / "checkpoints" / "step-00000002.ckpt", weights_only=True)
    names = list(checkpoint["state_dict"])
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names), names[:4]
    assert len(names) == 2 * 7 * TINY["n_layers"]  # A and B of the 7 projections of each block
    base = checkpoint["adapters"]["model"]
    assert base["checkpoint"] == str(Path(setup["policy"]).resolve()) and base["peft"]["rank"] == 4
    final = load_checkpoint(run_dir / "final")
    assert isinstance(final.layers[0].attention.wq, torch.nn.Linear) and final.config.dim == TINY["dim"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampling.keep_per_prompt=3", r"sampling.keep_per_prompt \(3\) exceeds sampling.samples_per_prompt \(2\)"),
        ("init.policy=null", "init.policy is required"),
        ("reward.terms=[{kind: checker, path: 'nowhere.module:score'}]", r"reward.terms\[0\].path: cannot import"),
        ("sft.data.train=[x.jsonl]", "set by the stage"),
        ("sampling.samples_per_prompt=0", "sampling.samples_per_prompt must be >= 1"),
        (
            "episodes.environment=alignment.shared.episodes:Environment",
            r"^episodes.max_tokens \(512\) exceeds the policy's max_seq_len \(256\)$",
        ),
        ("episodes.environment=json:dumps", "^episodes.environment: json:dumps is not an Environment"),
    ],
)
def test_bad_config_is_one_line_before_compute(setup, tmp_path, monkeypatch, override, message):
    monkeypatch.setattr(sampling, "generate", None)  # any sampling would fail with another error
    with pytest.raises(ConfigError, match=message) as caught:
        run_rejection_sampling(rs_config(setup, tmp_path, override))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "rejection-sampling-tiny" / SAMPLES).exists()


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "(6 * 7)"}}</tool_call>'


def test_tool_episodes_are_kept_as_transcripts_with_their_tools_and_sft_trains_on_the_policys_turns_alone(
    tmp_path, monkeypatch
):
    """``episodes.environment``: each sample is a tool episode (a scripted policy calls the calculator, then
    answers); the kept record is its transcript with the calculator's schema, and SFT's targets on it are the
    policy's two turns, token for token as the template renders them, never the tool's output."""
    from alignment.shared.tools import CALCULATOR
    from data.tokenizer.base import with_tool_instructions

    tokenizer = Tokenizer.load("default")
    policy = save_checkpoint(
        Transformer(ModelConfig(**{**TINY, "max_seq_len": 1024})), tmp_path / "sft", tokenizer_path=tokenizer.path
    )
    demo = write_demo_dataset(tmp_path / "demo", n_train=20, n_val=40, n_pairs=10, seed=0)

    def scripted(model, tokenizer, generator=None, **sampling_settings):
        def sample(rows, max_new_tokens):
            said = ["(6 * 7)" in tokenizer.decode(row) for row in rows]
            return [tokenizer.encode("The product is 42." if s else CALL) + [tokenizer.eot_id] for s in said]

        return sample

    monkeypatch.setattr(sampling, "generate_sampler", scripted)
    config = load_config(
        RejectionSamplingConfig, CONFIG,
        [
            *inputs({**setup_paths(demo), "policy": policy}, tmp_path), *FAST, "sft.data.seq_len=1024",
            "episodes.environment=alignment.shared.episodes:Environment", "episodes.max_tokens=1024",
            "sampling.response_max_tokens=40",
        ],
    )  # fmt: skip
    run_dir = run_rejection_sampling(config)
    stats = json.loads((run_dir / STATS).read_text())
    assert stats["mean_turns"] == 2 and stats["mean_tool_calls"] == 1 and stats["mean_malformed_calls"] == 0
    records = [json.loads(line) for line in (run_dir / SAMPLES).read_text().splitlines()]
    assert len(records) == 6 and all(r["tools"] == [CALCULATOR.schema()] for r in records)
    turns = records[0]["messages"][-3:]
    assert [(m["role"], m["content"]) for m in turns] == [
        ("assistant", CALL), ("tool", "42"), ("assistant", "The product is 42.")
    ]  # fmt: skip

    data = build_sft_data(
        SFTDataConfig(train=[str(run_dir / SAMPLES)], val=[demo["val"]], seq_len=1024, packing=False), tokenizer
    )
    ids, mask = tokenizer.encode_chat(with_tool_instructions(records[0]["messages"], records[0]["tools"]))
    row = data.train.row(0)
    targets = row["targets"].tolist()
    for i in range(len(ids) - 1):  # target i is ids[i + 1] exactly where the policy wrote it
        assert targets[i] == (ids[i + 1] if mask[i + 1] else -100), f"position {i}"
    assert tokenizer.decode([t for t in targets if t != -100]) == f"{CALL}<|eot_id|>The product is 42.<|eot_id|>"
    assert load_checkpoint(run_dir / "final").config.max_seq_len == 1024


def setup_paths(demo: dict) -> dict:
    return {"prompts": demo["prompts"], "val": demo["val"]}


def test_every_numeric_key_has_a_range_rule_and_the_preset_loads():
    missing = [key for key in numeric_fields(RejectionSamplingConfig) if range_of(RejectionSamplingConfig, key) is None]
    assert [key for key in missing if not key.startswith("sft.model.")] == []
    config = load_config(RejectionSamplingConfig, CONFIG)
    assert config.sampling.samples_per_prompt == 4 and config.sft.trainer.max_steps == 6


@pytest.mark.slow
def test_fsdp_rejection_sampling_on_two_processes(setup, tmp_path):
    """Sampling on rank 0, then SFT under 2-process FSDP2 on CPU: the second rank (started by Lightning from
    inside run_sft) finds the finished samples by their hash and does not sample again."""
    fsdp = ["sft.trainer.strategy=fsdp", "sft.trainer.devices=2"]
    result = run_cli("rejection-sampling", str(CONFIG), *inputs(setup, tmp_path), *FAST, *fsdp)
    run_dir = tmp_path / "rejection-sampling-tiny"
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert json.loads((run_dir / STATS).read_text())["kept"] == 6
    assert result.stderr.count("kept 6 samples") == 1  # sampled once, by rank 0
    assert result.stderr.count("not sampling again") == 1  # the rank Lightning started
