"""The one way a config value is refused: a ``ConfigError`` that names the key path, before any compute.

Config files are read here too, by ``read_yaml``: every command reads its YAML through it, so a syntax error or a
key given twice is one line naming the file and line, whichever command meets it.

Three kinds of rule, each written once:
- numeric ranges, for every numeric key of every schema (``RANGES``, by field name; ``check_ranges`` walks any
  config dataclass, so a stage's file, a pipeline's stage section and a data section built in code get the same
  check and the same message: ``optim.lr must be > 0 but got 0.0``);
- choices among allowed strings (``check_choices``), for the data sections that are plain strings rather than
  ``Literal`` types (OmegaConf checks those when a file is loaded);
- cross-key rules, in each schema's own check function (``check_<stage>_config`` beside the schema), raising
  ``ConfigError`` in the same words.

Lives in the lowest layer because ``data/`` checks its sections with it as much as the stages do.
"""

from __future__ import annotations

import logging
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from models.errors import ConfigError, one_line

log = logging.getLogger(__name__)

# The range of every numeric config field, by field name ("section.field" wins over "field"), as
# (low, high, low_open, high_open); None = unbounded. tests/faults/test_config_errors.py checks that every
# numeric field of every stage schema has a rule here, or is listed in UNBOUNDED.
AT_LEAST_1 = (1, None, False, False)
AT_LEAST_0 = (0, None, False, False)
POSITIVE = (0, None, True, False)
ANY_FINITE = (None, None, False, False)  # any number but NaN and infinity
UNIT = (0, 1, False, False)  # a probability or a discount: [0, 1]
UNIT_HALF_OPEN = (0, 1, False, True)  # [0, 1): a fraction held out, an Adam beta
RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    # optimiser
    "lr": POSITIVE,
    "min_lr": AT_LEAST_0,
    "warmup_steps": AT_LEAST_0,
    "weight_decay": AT_LEAST_0,
    "eps": POSITIVE,
    "grad_clip": POSITIVE,
    "z_loss": AT_LEAST_0,
    "betas": UNIT_HALF_OPEN,
    # trainer, checkpoints, loaders
    "devices": AT_LEAST_1,
    "num_nodes": AT_LEAST_1,
    "max_steps": AT_LEAST_1,
    "accumulate_grad_batches": AT_LEAST_1,
    "val_every_n_steps": AT_LEAST_1,
    "log_every_n_steps": AT_LEAST_1,
    "ac_every": AT_LEAST_1,
    "loss_chunk_size": AT_LEAST_1,
    "peak_tflops": POSITIVE,
    "max_nonfinite_steps": AT_LEAST_0,
    "collective_timeout_s": POSITIVE,
    "every_n_steps": AT_LEAST_1,
    "keep_last": AT_LEAST_1,
    "seq_len": AT_LEAST_1,
    "micro_batch_size": AT_LEAST_1,
    "num_workers": AT_LEAST_0,
    "val_batches": AT_LEAST_1,
    "seed": AT_LEAST_0,
    # sampling and evaluation
    "max_new_tokens": AT_LEAST_1,
    "temperature": AT_LEAST_0,
    "generations": AT_LEAST_0,
    "max_new_tokens_margin": AT_LEAST_0,
    "batch_size": AT_LEAST_1,
    "table_rows": AT_LEAST_0,
    "every_n_rollouts": AT_LEAST_1,
    "top_k": AT_LEAST_1,
    "top_p": (0, 1, True, False),
    # reward model
    "margin": AT_LEAST_0,
    "normalization_pairs": AT_LEAST_1,
    # PPO
    "rollout_batch_size": AT_LEAST_1,
    "minibatch_size": AT_LEAST_1,
    "epochs": AT_LEAST_1,
    "response_max_tokens": AT_LEAST_1,
    "ppo.temperature": AT_LEAST_0,  # 0: greedy rollouts (tests compare rank layouts with them)
    "clip_ratio": POSITIVE,
    "clip_value": POSITIVE,
    "gamma": UNIT,
    "lam": UNIT,
    "reward_clip": POSITIVE,
    "missing_eos_penalty": AT_LEAST_0,
    "kl_coef": AT_LEAST_0,
    "kl_target": POSITIVE,
    "kl_horizon": AT_LEAST_1,
    "entropy_coef": AT_LEAST_0,
    "critic_warmup_rollouts": AT_LEAST_0,
    # GRPO / RLOO, rewards, held-out evaluation
    "prompts_per_rollout": AT_LEAST_1,
    "group_size": (1, None, True, False),  # > 1: a group of one has no baseline
    "pass_k": AT_LEAST_0,
    "pass_k_prompts": AT_LEAST_0,
    # DPO / IPO / SimPO
    "beta": POSITIVE,
    "label_smoothing": (0, 0.5, False, True),
    "simpo_gamma": AT_LEAST_0,
    # rejection sampling
    "samples_per_prompt": AT_LEAST_1,
    "keep_per_prompt": AT_LEAST_1,
    "min_score": ANY_FINITE,
    "max_prompts": AT_LEAST_0,
    # data
    "val_fraction": UNIT_HALF_OPEN,
    "shard_tokens": AT_LEAST_1,
    "num_proc": AT_LEAST_1,
    "max_prompt_tokens": AT_LEAST_1,
    "short_answer_max_tokens": AT_LEAST_1,
    "short_answer_factor": AT_LEAST_1,
    "short_answer_target_share": UNIT_HALF_OPEN,
    # LoRA adapters (models/adapters.py)
    "peft.rank": AT_LEAST_1,
    "peft.alpha": POSITIVE,
    "peft.dropout": UNIT_HALF_OPEN,
    # pipeline
    "n_train": AT_LEAST_1,
    "n_val": AT_LEAST_1,
    "n_pairs": AT_LEAST_1,
    "short_share": UNIT,
    "line_count_max": (1, 9, False, False),
    "line_count_miscount": UNIT,
    "prompts": AT_LEAST_0,
}
# Numeric fields whose own dataclass checks them (ModelConfig.__post_init__ names model.KEY), save for its sizes below.
UNBOUNDED = {"model"}
# A model section's sizes, bounded above far past any model trained (Llama 3.1 405B: 126 layers, dim 16384, 128 heads,
# FFN 53248; vocabularies of 256K tokens; contexts of 10M): a value past them is a typo, and building even a
# meta-device model of it (one module per layer) or planning it would run for hours or overflow (issue 31).
MODEL_RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "n_layers": (1, 1024, False, False),
    "dim": (1, 2**20, False, False),
    "n_heads": (1, 2**14, False, False),
    "n_kv_heads": (1, 2**14, False, False),
    "head_dim_override": (1, 2**14, False, False),
    "vocab_size": (1, 2**24, False, False),
    "multiple_of": (1, 2**20, False, False),
    "ffn_hidden_dim": (1, 2**22, False, False),
    "ffn_dim_multiplier": (0, 256, True, False),
    "max_seq_len": (1, 2**24, False, False),
}


def _describe(rule: tuple[float | None, float | None, bool, bool]) -> str:
    low, high, low_open, high_open = rule
    if high is None:
        return f"> {low}" if low_open else f">= {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def _in_range(value: float, rule: tuple[float | None, float | None, bool, bool]) -> bool:
    low, high, low_open, high_open = rule
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or (value < high if high_open else value <= high)


def numeric_fields(schema: type, prefix: str = "") -> dict[str, Any]:
    """Every int/float (or list of them) field of a config schema, by key path, with its type."""
    found: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for item in fields(schema):
        kind = hints[item.name]
        if is_dataclass(kind):
            found.update(numeric_fields(kind, f"{prefix}{item.name}."))
            continue
        args = set(typing.get_args(kind)) | {kind}
        numeric = args & {int, float} or any(set(typing.get_args(a)) & {int, float} for a in args)  # list[float]
        if numeric and bool not in args:
            found[f"{prefix}{item.name}"] = kind
    return found


def range_rule(path: str) -> tuple[float | None, float | None, bool, bool] | None:
    """The rule for key path ``path`` (e.g. "sft.optim.lr" in a pipeline, "optim.lr" in a stage)."""
    parts = path.split(".")
    if parts[0] in UNBOUNDED or (len(parts) > 1 and parts[-2] in UNBOUNDED):
        return None
    if len(parts) > 1 and f"{parts[-2]}.{parts[-1]}" in RANGES:
        return RANGES[f"{parts[-2]}.{parts[-1]}"]
    return RANGES.get(parts[-1])


def check_ranges(config: Any, source: str = "", prefix: str = "") -> None:
    """Raise a ConfigError naming the key path of the first numeric field outside its range (after ``source``,
    the file, when there is one), and refuse min_lr > lr (the schedule would climb)."""
    for item in fields(config):
        value, path = getattr(config, item.name), f"{prefix}{item.name}"
        if is_dataclass(value) and item.name in UNBOUNDED:
            check_model_size(value, source, f"{path}.")
        if is_dataclass(value):
            check_ranges(value, source, f"{path}.")
            continue
        rule = range_rule(path)
        if rule is None or value is None or isinstance(value, bool):
            continue
        for index, element in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(element, (int, float)) and not _in_range(element, rule):
                where = f"{path}[{index}]" if isinstance(value, list) else path
                raise ConfigError(f"{_at(source)}{where} must be {_describe(rule)} but got {element!r}")
    names = {item.name for item in fields(config)}
    if {"lr", "min_lr"} <= names and config.min_lr > config.lr:
        raise ConfigError(f"{_at(source)}{prefix}min_lr ({config.min_lr}) must be <= {prefix}lr ({config.lr})")


def check_model_size(model: Any, source: str = "", prefix: str = "model.") -> None:
    """Raise a ConfigError naming the first size of a model config outside ``MODEL_RANGES`` (key ``prefix`` + field):
    for a model section of a config, a ``--model`` preset or a checkpoint folder's config alike."""
    for name, rule in MODEL_RANGES.items():
        value = getattr(model, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not _in_range(value, rule):
            raise ConfigError(f"{_at(source)}{prefix}{name} must be {_describe(rule)} but got {value!r}")


def check_choices(config: Any, choices: Mapping[str, Sequence[str]], source: str = "", prefix: str = "") -> None:
    """Each field named in ``choices`` holds one of its allowed values."""
    for key, allowed in choices.items():
        if getattr(config, key) not in allowed:
            raise ConfigError(
                f"{_at(source)}{prefix}{key} must be one of {', '.join(allowed)}, got {getattr(config, key)!r}"
            )


def read_yaml(path: Path) -> Any:
    """The one reader of a YAML config (a stage's, a pipeline's, a model preset): its top level as OmegaConf reads it,
    or a one-line ``ConfigError`` naming the file and line (a syntax error, a key given twice in one mapping). Safe:
    no tags that build objects, no custom resolvers."""
    try:
        return OmegaConf.load(path)
    except yaml.constructor.ConstructorError as error:
        # PyYAML keeps the last of two equal keys; OmegaConf refuses them in a multi-line message: one line instead
        if error.problem and error.problem.startswith("found duplicate key") and error.problem_mark:
            key = error.problem.removeprefix("found duplicate key").strip()
            first = _first_key_line(path, error.context_mark, key)
            where = f" (first at line {first})" if first else ""
            raise ConfigError(f"{path}, line {error.problem_mark.line + 1}: duplicate key {key!r}{where}") from error
        raise ConfigError(f"{path}: cannot parse YAML: {one_line(error)}") from error
    except Exception as error:  # a syntax error's text carries the line
        raise ConfigError(f"{path}: cannot parse YAML: {one_line(error)}") from error


def _first_key_line(path: Path, mapping: Any, key: str) -> int | None:
    """The line of ``key``'s first occurrence in the mapping that starts at ``mapping`` (a yaml mark)."""
    try:
        nodes = [yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)]
    except yaml.YAMLError:
        return None
    while nodes:
        node = nodes.pop()
        if isinstance(node, yaml.MappingNode):
            if mapping is not None and (node.start_mark.line, node.start_mark.column) == (mapping.line, mapping.column):
                return next((k.start_mark.line + 1 for k, _ in node.value if getattr(k, "value", None) == key), None)
            nodes += [value for _, value in node.value]
        elif isinstance(node, yaml.SequenceNode):
            nodes += node.value
    return None


def _at(source: str) -> str:
    return f"{source}: " if source else ""
