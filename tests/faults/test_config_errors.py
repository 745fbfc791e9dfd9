"""Config errors name the key: every field of every stage schema refuses a wrong type and (numeric fields) an
out-of-range value with a ConfigError naming its key path; every key an error message names exists; and a
stage started from ``init.checkpoint`` records the model it really built."""

from __future__ import annotations

import ast
import csv
import re
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from alignment.commands.pipeline import PipelineConfig, pipeline_steps
from alignment.schemas.dpo import DPOConfig
from alignment.schemas.pretrain import PretrainConfig
from alignment.schemas.rejection_sampling import RejectionSamplingConfig
from alignment.schemas.reward import RMConfig
from alignment.schemas.rl import GRPOConfig, PPOConfig
from alignment.schemas.sft import SFTConfig
from alignment.stages.sft import check_generation_budgets, plan_generations
from data.tokenizer.tokenizer import Tokenizer
from models.config_checks import Range, numeric_fields, range_of
from models.errors import ConfigError
from models.formats.checkpoint import save_checkpoint
from models.model import ModelConfig, Transformer
from trainer.checks import check_initial_model
from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = {
    "pretrain": PretrainConfig,
    "sft": SFTConfig,
    "rm": RMConfig,
    "ppo": PPOConfig,
    "grpo": GRPOConfig,
    "dpo": DPOConfig,
    "rejection_sampling": RejectionSamplingConfig,
    "pipeline": PipelineConfig,
}


def leaves(schema: type, prefix: str = "", owners: dict[str, type] | None = None) -> dict[str, Any]:
    """Every non-section field, by key path, with its type (``owners`` collects the dataclass holding each)."""
    found: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for item in fields(schema):
        kind = hints[item.name]
        if is_dataclass(kind):
            found.update(leaves(kind, f"{prefix}{item.name}.", owners))
        else:
            found[f"{prefix}{item.name}"] = kind
            if owners is not None:
                owners[f"{prefix}{item.name}"] = schema
    return found


def distinct_fields() -> list[tuple[str, str, Any]]:
    """(stage, key, type) once per field of each section dataclass: optim.lr of five schemas is one field.
    A field is identified by its dataclass, its name and its key path's last section (ppo.temperature and
    sample.temperature have different ranges)."""
    seen, out = set(), []
    for stage, schema in SCHEMAS.items():
        owners: dict[str, type] = {}
        for key, kind in leaves(schema, owners=owners).items():
            identity = (owners[key], key.split(".")[-1], key.split(".")[-2] if "." in key else "")
            if identity not in seen:
                seen.add(identity)
                out.append((stage, key, kind))
    return out


def wrong_value(kind: Any) -> str | None:
    """An override value of the wrong type for a field of type ``kind`` (None: nothing is wrong for it)."""
    args = set(typing.get_args(kind)) - {type(None)} or {kind}
    if typing.get_origin(kind) is Literal:
        return "no_such_choice"
    if any(is_dataclass(a) for a in args):
        return "not_a_section"
    if bool in args:
        return "maybe"
    if args & {int, float}:
        return "not_a_number"
    if any(typing.get_origin(a) is list or a is list for a in args | {kind}):
        return "{a: 1}"
    if str in args:
        return "[1, 2]"
    if any(typing.get_origin(a) is Literal for a in args):
        return "no_such_choice"
    return None


TYPE_CASES = [
    pytest.param(stage, key, value, id=f"{stage}:{key}")
    for stage, key, kind in distinct_fields()
    if (value := wrong_value(kind)) is not None
]


@pytest.mark.parametrize(("stage", "key", "value"), TYPE_CASES)
def test_wrong_type_names_the_key(stage, key, value):
    with pytest.raises(ConfigError) as caught:
        load_config(SCHEMAS[stage], None, [f"{key}={value}"])
    assert key.split(".")[-1] in str(caught.value) and key.split(".")[0] in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def test_every_field_gets_a_wrong_type_case():
    covered = {(stage, key) for stage, key, _ in (case.values for case in TYPE_CASES)}
    every = {(stage, key) for stage, key, _ in distinct_fields()}
    assert covered == every, sorted(every - covered)
    assert len(every) > 100  # every section of every stage schema, not a sample


def outside(rule: Range, kind: Any) -> Any:
    """The nearest value outside ``rule`` (below its low end; infinity where any finite number is allowed)."""
    integer = int in typing.get_args(kind) or kind is int
    if rule.gt is not None:
        return rule.gt if integer else float(rule.gt)
    if rule.ge is not None:
        return rule.ge - 1
    if rule.le is not None or rule.lt is not None:
        return (rule.le if rule.le is not None else rule.lt) + 1
    return ".inf"  # any finite number (a score threshold): infinity is outside


NUMERIC = [(stage, key, kind) for stage, key, kind in distinct_fields() if key in numeric_fields(SCHEMAS[stage])]
RANGE_CASES = [
    pytest.param(stage, key, outside(rule, kind), id=f"{stage}:{key}")
    for stage, key, kind in NUMERIC
    if (rule := range_of(SCHEMAS[stage], key)) is not None
] + [
    pytest.param(stage, key, 1.5, id=f"{stage}:{key}:above")
    for stage, key, kind in NUMERIC
    if (rule := range_of(SCHEMAS[stage], key)) is not None and 1 in (rule.le, rule.lt)
]


@pytest.mark.parametrize(("stage", "key", "value"), RANGE_CASES)
def test_out_of_range_names_the_key(stage, key, value):
    override = f"{key}=[0.9, {value}]" if key.endswith("betas") else f"{key}={value}"
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(SCHEMAS[stage], None, [override])


@pytest.mark.parametrize("key", ["dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of"])
def test_model_section_ranges_are_checked_by_model_config(key):
    with pytest.raises(ConfigError, match=rf"model\.{key}"):
        load_config(PretrainConfig, None, [f"model.{key}=-1"])


def test_every_numeric_field_has_a_range_rule():
    """A new numeric field must declare its range (``bounded``); model.* is ModelConfig's own, bar its sizes."""
    for schema in SCHEMAS.values():
        missing = [
            key
            for key in numeric_fields(schema)
            if range_of(schema, key) is None and "model" not in key.split(".")[:-1]
        ]  # model.* (also sft.model.* inside rejection sampling) is ModelConfig's own
        assert not missing, missing


def test_min_lr_above_lr_is_refused():
    with pytest.raises(ConfigError, match=r"critic_optim\.min_lr .* critic_optim\.lr"):
        load_config(PPOConfig, None, ["critic_optim.lr=1e-5", "critic_optim.min_lr=1e-4"])


def test_bundled_configs_pass_the_range_checks():
    for stage, schema in SCHEMAS.items():
        for path in sorted((ROOT / "configs" / stage).glob("*.yaml")):
            load_config(schema, path)


# ---- every config key named in an error message exists

FILE_SUFFIXES = {
    "safetensors",
    "json",
    "yaml",
    "yml",
    "model",
    "bin",
    "pth",
    "ckpt",
    "jsonl",
    "txt",
    "tiktoken",
    "csv",
    "png",
    "md",
    "pt",
}


def valid_paths() -> set[str]:
    paths: set[str] = set()
    for stage, schema in SCHEMAS.items():
        for key in leaves(schema):
            parts = key.split(".")
            prefixes = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
            paths |= prefixes
            if stage in pipeline_steps():  # the pipeline sets stage keys as STAGE.KEY (sft.trainer.max_steps=...)
                paths |= {f"{stage}.{p}" for p in prefixes}
    return paths


def error_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string constant inside a raise statement of a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for child in ast.walk(node.exc):
                if isinstance(child, ast.Constant) and isinstance(child.value, str):
                    found.append((child.lineno, child.value))
    return found


VALID = valid_paths()
SECTIONS = {key.split(".")[0] for key in VALID}
KEY_TOKEN = re.compile(r"(?<![\w./])([a-z_]+(?:\.[a-z_][a-z_0-9]*)+)(?![\w/(])")


def unknown_keys(text: str) -> list[str]:
    """Tokens of ``text`` that look like config keys (SECTION.key...) but are none."""
    return [
        name
        for name in KEY_TOKEN.findall(text)
        if name.split(".")[0] in SECTIONS and name.split(".")[-1] not in FILE_SUFFIXES and name not in VALID
    ]


def test_every_key_named_in_an_error_exists():
    bad, checked = [], 0
    for package in ("trainer", "alignment", "data", "models"):
        for module in sorted((ROOT / package).rglob("*.py")):
            for line, text in error_strings(module):
                checked += len(KEY_TOKEN.findall(text))
                bad += [f"{module.relative_to(ROOT)}:{line}: {name}" for name in unknown_keys(text)]
    assert not bad, bad
    assert checked > 50  # the scan does see the keys error messages name


def test_the_key_check_catches_a_wrong_key():
    """Not vacuous: the key the PPO estimator error once named is caught; real keys and file names are not."""
    assert unknown_keys("ppo.kl.estimator must be 'k1' or 'k3'") == ["ppo.kl.estimator"]
    assert unknown_keys("set optim.lrate=1e-4") == ["optim.lrate"]
    assert unknown_keys("ppo.kl_estimator must be 'k1'; see model.safetensors and sft.trainer.max_steps") == []


# ---- init.checkpoint wins over `model`, and config.yaml says so


def test_init_checkpoint_overrides_and_records_the_model(tmp_path, caplog):
    torch.manual_seed(0)
    built = ModelConfig.from_preset("tiny")
    built.n_layers = 2
    folder = save_checkpoint(Transformer(built), tmp_path / "two-layer")
    config = load_config(
        SFTConfig, ROOT / "configs/sft/tiny.yaml", [f"init.checkpoint={folder}", "data.train=[x.jsonl]"]
    )
    assert config.model.n_layers == 4  # the preset's fallback model
    check_initial_model(config, Tokenizer.load("default"), built)
    assert config.model == built
    assert "model section ignored" in caplog.text


# ---- SFT: the generation budget fits the context, checked before training


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


def examples(prompt_lengths: list[int], reference_lengths: list[int]) -> list[dict]:
    return [
        {"prompt_ids": [1] * p, "reference": "x" * r, "where": f"val.jsonl, line {i + 1}"}
        for i, (p, r) in enumerate(zip(prompt_lengths, reference_lengths))
    ]


def test_generation_budgets_fit_the_context_and_count_cut_references():
    config = load_config(SFTConfig, None, ["data.train=[x.jsonl]", "eval.batch_size=2", "eval.max_new_tokens_margin=8"])
    planned = plan_generations(examples([45, 10, 200, 30], [458, 5, 20, 100]), CharTokenizer(), config, max_seq_len=256)
    for batch in planned:
        longest = max([45, 10, 200, 30][i] for i in batch.indices)
        assert longest + max(batch.budgets) <= 256
    by_index = {i: b for batch in planned for i, b in zip(batch.indices, batch.budgets)}
    # batches by prompt length: (10, 30) with room 226, then (45, 200) with room 56
    assert by_index[1] == 5 + 8 and by_index[3] == 100 + 8  # they fit: reference length plus the margin
    assert by_index[2] == 20 + 8 and by_index[0] == 256 - 200  # 458 + 8 is cut to the room the batch leaves
    assert sum(batch.cut for batch in planned) == 1  # the 458-token reference cannot be matched in 56 tokens
    assert check_generation_budgets(config, examples([45, 10, 200, 30], [458, 5, 20, 100]), CharTokenizer(), 256) == 1


def test_a_prompt_that_fills_the_context_is_a_config_error_before_training():
    config = load_config(SFTConfig, None, ["data.train=[x.jsonl]"])
    with pytest.raises(ConfigError, match=r"val\.jsonl, line 2 has 256 tokens.*eval\.generations=0"):
        check_generation_budgets(config, examples([10, 256], [3, 3]), CharTokenizer(), 256)
    assert (
        check_generation_budgets(
            load_config(SFTConfig, None, ["data.train=[x.jsonl]", "eval.generations=0"]),
            examples([10, 256], [3, 3]),
            CharTokenizer(),
            256,
        )
        == 0
    )


def test_sft_with_answers_longer_than_the_context_validates_instead_of_crashing(tmp_path):
    """The reported crash: ~450-token answers, max_seq_len 256, truncated training rows; the first validation
    died in generate() ("prompt of 45 tokens + max_new_tokens 458 exceeds max_seq_len 256") and the run was lost."""
    from alignment.stages.sft import run_sft
    from tests.helpers import write_jsonl

    rows = [
        {"prompt": f"Recite speech {i}.", "response": " ".join(["ROMEO speaks at length"] * 110)} for i in range(12)
    ]
    train = write_jsonl(tmp_path / "train.jsonl", rows[:8])
    val = write_jsonl(tmp_path / "val.jsonl", rows[8:])
    config = load_config(SFTConfig, ROOT / "configs/sft/tiny.yaml", [
        f"data.train=[{train}]", f"data.val=[{val}]", f"run.out_dir={tmp_path / 'runs'}", "logger.kind=csv",
        "trainer.max_steps=2", "trainer.val_every_n_steps=2", "eval.generations=4", "eval.batch_size=2",
        "data.packing=false",
    ])  # fmt: skip
    run_dir = run_sft(config)
    with open(run_dir / "csv" / "metrics.csv", newline="") as handle:
        cut = [float(row["val/cut_references"]) for row in csv.DictReader(handle) if row["val/cut_references"]]
    assert cut == [4.0]  # all four references are longer than the room their prompts leave: counted as cut
    assert (run_dir / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("logger.kindx=none", "invalid config key 'logger.kindx'"),  # not blamed on reward.terms (a list of sections)
        ("reward.terms=[{kind: checker, pathx: a}]", "'pathx'.*Did you mean: 'path'"),
        ("reward.terms=[3]", r"reward.terms\[0\] must be a section"),
        ("reward.terms=5", "reward.terms must be a list"),
    ],
)
def test_lists_of_sections_get_errors_that_name_the_right_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, ROOT / "configs/grpo/tiny.yaml", [override])


@pytest.mark.parametrize("command", ["sft", "pipeline", "plan"])
def test_a_config_folder_instead_of_a_file_names_the_yaml_files_in_it(command, capsys):
    """Before: `lantern sft configs/sft` said the folder "does not exist"."""
    from alignment.commands.cli import main

    folder = "configs/pipeline" if command == "pipeline" else "configs/sft"
    assert main([command, folder]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lantern {command}: error: config file {folder} is a folder; give one of its YAML files: ")
    assert "tiny.yaml" in err and "\n" not in err, err


@pytest.mark.parametrize("override", ["ppo.trainer.max_stepz=3", "grpo.optim.lr=-1"], ids=["bad-key", "bad-value"])
def test_a_bad_override_of_a_later_pipeline_stage_is_one_line_before_any_compute(tmp_path, override):
    """Before: caught only after prepare and pretrain had run (`lantern plan` found it at once)."""
    from alignment.commands.pipeline import run_pipeline

    out = tmp_path / "P"
    with pytest.raises(ConfigError) as error:
        run_pipeline(str(ROOT / "configs/pipeline/tiny.yaml"), [f"out_dir={out}", override])
    assert "\n" not in str(error.value)
    assert not (out / "data").exists() and not (out / "pretrain").exists()
