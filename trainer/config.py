"""Typed YAML configs: OmegaConf files checked against dataclass schemas, with ``key=value`` overrides.

Every stage config is a dataclass built from the sections below. Loading fails before any compute on an
unknown key or a wrong type, naming the full key path (and the nearest valid key). YAML is read with a safe
loader and no custom resolvers (``read_yaml``), so a config never executes code and a key given twice is refused.

One rule for a section that takes a preset (the model: ``model``, rejection sampling's ``sft.model``), in the file
and on the command line alike: given by name or file (``model: small``, ``model=path.yaml``) it IS that preset and
replaces the section; ``model.KEY=V`` (or a ``{KEY: V}`` mapping) sets those keys only; keys it omits take the
section type's declared defaults. Overrides apply left to right.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.config_checks import bounded, check_config, model_preset_path, model_presets, read_yaml, shipped_path
from models.errors import ConfigError, one_line
from trainer.optim_config import MuonConfig, OptimConfig, check_optim_sections

__all__ = ["MuonConfig", "OptimConfig"]  # the optim section's types live in optim_config.py; stages import them here

Strategy = Literal["single", "ddp", "fsdp"]
Precision = Literal["auto", "32-true", "bf16-mixed", "bf16-true"]
log = logging.getLogger(__name__)


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = "runs"  # the run writes to OUT_DIR/NAME
    seed: int = bounded(1234, ge=0)


@dataclass
class TrainerConfig:
    strategy: Strategy = "single"
    precision: Precision = "auto"  # auto: bf16-mixed on a GPU with bf16, else 32-true; recorded resolved
    accelerator: str = "auto"  # auto | cpu | gpu
    devices: int = bounded(1, ge=1)
    num_nodes: int = bounded(1, ge=1)
    max_steps: int = bounded(1000, ge=1)  # optimizer steps
    accumulate_grad_batches: int = bounded(1, ge=1)
    val_every_n_steps: int = bounded(100, ge=1)
    log_every_n_steps: int = bounded(10, ge=1)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_every: int = bounded(2, ge=1)  # selective: checkpoint every k-th block
    compile: bool | Literal["auto"] = "auto"  # torch.compile each block; auto: on CUDA only; recorded resolved
    cpu_offload: bool = False  # FSDP2 parameter/gradient offload to CPU
    loss_chunk_size: int | None = bounded(1024, ge=1)  # tokens per LM-head chunk; None materialises full logits
    peak_tflops: float | None = bounded(None, gt=0)  # per device, for MFU; None: known GPUs by name, measured on CPU
    init_device: Literal["cpu", "meta"] = "cpu"  # meta: allocate weights only after sharding (large models)
    # NaN/Inf loss: 0 stops at the first such step; N > 0 skips up to N in a row, keeping the last good checkpoint
    max_nonfinite_steps: int = bounded(0, ge=0)
    float32_matmul_precision: Literal["auto", "highest", "high", "medium"] = "auto"  # auto: high on CUDA
    collective_timeout_s: float = bounded(1800.0, gt=0)  # ddp / fsdp: a rank waits this long for the others
    # true: a run whose plan says it does not fit this device stops before loading weights, naming the knob; false:
    # it runs anyway (the plan printed, and held against what was measured at the end either way)
    plan_check: bool = True

    def check_fields(self, prefix: str) -> None:
        if self.strategy == "single" and (self.devices != 1 or self.num_nodes != 1):
            raise ConfigError(
                f"{prefix}strategy 'single' runs one process, but {prefix}devices={self.devices} and "
                f"{prefix}num_nodes={self.num_nodes}: use 'ddp' or 'fsdp' for more"
            )
        if self.cpu_offload and self.strategy != "fsdp":
            raise ConfigError(f"{prefix}cpu_offload needs {prefix}strategy 'fsdp'")
        if self.cpu_offload and self.accelerator == "cpu":
            raise ConfigError(CPU_OFFLOAD_NEEDS_GPUS.format(prefix=prefix))
        if self.init_device == "meta" and self.strategy != "fsdp":
            raise ConfigError(
                f"{prefix}init_device 'meta' needs {prefix}strategy 'fsdp' (weights materialise after sharding)"
            )


CPU_OFFLOAD_NEEDS_GPUS = "{prefix}cpu_offload moves FSDP shards from GPU memory to pinned CPU memory: it needs GPUs"


@dataclass
class CheckpointConfig:
    every_n_steps: int = bounded(500, ge=1)
    keep_last: int = bounded(3, ge=1)
    resume: str = "auto"  # auto (latest in the run folder, if any) | none | PATH


@dataclass
class LoggerConfig:
    kind: Literal["wandb", "csv", "none"] = "wandb"
    project: str = "lantern"
    mode: Literal["auto", "offline", "online"] = "auto"  # auto: online only with an API key
    group: str | None = None  # the pipeline sets one per pipeline run
    job_type: str | None = None  # None: the stage (pretrain, sft, rm, ...)
    tags: list[str] = field(default_factory=list)
    system_stats: bool = True  # W&B system charts (GPU, CPU, memory, disk, network)
    # checkpoints as W&B model artifacts: off | final | all (every checkpoint too); YAML false / true: off / final
    log_model: bool | Literal["off", "final", "all"] = "off"


@dataclass
class HarnessEvalConfig:
    """lm-evaluation-harness tasks scored at each validation (docs/evaluation.md); none by default. Names, folders
    and lm-eval itself are checked at load."""

    harness_tasks: list[str] = field(default_factory=list)  # lm-eval task or group names, e.g. [arc_easy]
    harness_limit: int | None = bounded(100, ge=1)  # examples per task each time; None: all (slow in a run)
    harness_num_fewshot: int | None = bounded(None, ge=0)  # None: each task's own
    harness_include_path: list[str] = field(default_factory=list)  # folders of task YAMLs (demo-data's harness/)
    harness_apply_chat_template: bool = False  # prompts through the tokenizer's chat template
    harness_batch_size: int = bounded(8, ge=1)  # rows per forward, prompts per generate
    harness_confirm_run_unsafe_code: bool = False  # lm-eval's opt-in to run generated code (humaneval_local)

    def check_fields(self, prefix: str) -> None:
        if self.harness_tasks:
            from trainer.harness_tasks import check_harness_config

            check_harness_config(self, prefix)


class StageConfig:
    """What every stage config with ``optim`` and ``trainer`` sections checks across them, at load."""

    def schedule_steps(self) -> int:
        """Optimizer updates over the run, the length the optim schedule spans (warmup_steps and decay_steps count
        these): trainer.max_steps; an RL stage makes several updates per step."""
        return self.trainer.max_steps  # type: ignore[attr-defined]

    def optim_sections(self) -> dict[str, OptimConfig]:
        """Every optim section of the stage by key (PPO's critic_optim too)."""
        sections = {item.name: getattr(self, item.name) for item in fields(self)}  # type: ignore[arg-type]
        return {key: value for key, value in sections.items() if isinstance(value, OptimConfig)}

    def check_fields(self, prefix: str) -> None:
        optim, trainer = getattr(self, "optim", None), getattr(self, "trainer", None)
        if optim is None or trainer is None:
            return
        if optim.warmup_steps > trainer.max_steps:
            log.warning(
                "%soptim.warmup_steps (%d) exceeds %strainer.max_steps (%d): the learning rate never reaches optim.lr",
                prefix,
                optim.warmup_steps,
                prefix,
                trainer.max_steps,
            )
        check_optim_sections(self, prefix)


Schema = TypeVar("Schema")


def takes_preset(section: Any) -> bool:
    """Whether a section of this type may be given as a preset name or a YAML file of its fields instead of its keys:
    one that builds itself from such a preset (``from_preset``: the model, configs/model/NAME.yaml)."""
    return is_dataclass(section) and callable(getattr(section, "from_preset", None))


def load_preset(value: Any, source: str) -> DictConfig:
    """``small`` (a preset name) or ``path/to/model.yaml``: that preset's fields, the whole section."""
    name = str(value)
    path = model_preset_path(name)
    if not path.is_file():
        raise ConfigError(f"{source}: model preset {name!r} not found (looked for {path}); presets: {model_presets()}")
    preset = read_yaml(path)
    if not isinstance(preset, DictConfig):
        raise ConfigError(f"{path}: a model preset must be a mapping of model keys, got {type(preset).__name__}")
    if not preset:  # an empty file would silently stand for the default model
        raise ConfigError(f"{source}: {path} is empty: a model preset names the model's keys (dim, n_layers, ...)")
    return preset


def _section_at(schema: type, path: list[str]) -> type | None:
    """The section type (a dataclass) at key path ``path`` of ``schema`` (``sft.model`` -> ModelConfig), else None."""
    current: Any = schema
    for part in path:
        if not is_dataclass(current):
            return None
        kind = typing.get_type_hints(current).get(part)
        if typing.get_origin(kind) is list:  # a list of sections (reward.terms) is not one
            return None
        options = (kind, *typing.get_args(kind))  # an optional section: X | None
        current = next((option for option in options if is_dataclass(option)), None)
    return current


def _preset_sections(schema: type, prefix: str = "") -> dict[str, Any]:
    """Every section of ``schema`` that takes a preset, by key path, with its type's declared defaults: what such a
    section holds besides the keys it is given (``model`` -> ModelConfig's; ``sft.model`` in rejection sampling)."""
    found: dict[str, Any] = {}
    for item in fields(schema):
        section = _section_at(schema, [item.name])
        if section is not None and takes_preset(section):
            found[f"{prefix}{item.name}"] = {
                f.name: f.default for f in fields(section) if f.default is not dataclasses.MISSING
            }
        elif section is not None:
            found.update(_preset_sections(section, f"{prefix}{item.name}."))
    return found


def _expand_presets(raw: DictConfig, schema: type, source: str) -> None:
    """Each section of ``raw`` written as a preset name or file (``model: small``, ``sft: {model: tiny}``) becomes
    that preset's fields, at any depth."""
    for key in list(raw.keys()):
        section, value = _section_at(schema, [str(key)]), raw.get(key)
        if section is None:
            continue
        if isinstance(value, str) and takes_preset(section):
            raw[key] = load_preset(value, source)
        elif isinstance(value, DictConfig):
            _expand_presets(value, section, source)


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, _, raw = item.partition("=")
    if not key:
        raise ConfigError(f"override {item!r} has no key")
    # The value is YAML (numbers, bools, [lists], {maps}) as it would be written in the file; anything that
    # only YAML's block syntax would turn into a mapping ("ROMEO:") stays the plain string typed.
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    if isinstance(value, dict) and not raw.lstrip().startswith("{"):
        value = raw
    return key.strip(), value


def _explain(error: OmegaConfBaseException, schema: type, source: str) -> ConfigError:
    key = getattr(error, "full_key", None) or "?"
    message = str(error).splitlines()[0]
    hint = ""
    if "Did you mean" not in message and isinstance(error, Exception) and "not in" in message:
        parent_type = _type_at(schema, key.split(".")[:-1])
        if parent_type is not None:
            names = [f.name for f in fields(parent_type)]
            close = difflib.get_close_matches(key.split(".")[-1], names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else f" Valid keys: {names}"
    return ConfigError(f"{source}: invalid config key {key!r}: {message}{hint}")


def _container_mismatch(raw: Any, schema: type, prefix: str = "") -> str | None:
    """Where plain ``raw`` holds a scalar or list for a section, or a mapping or scalar for a list: the key path
    and what is wrong, or None."""
    if not isinstance(raw, dict) or not is_dataclass(schema):
        return None
    hints = typing.get_type_hints(schema)
    for name, value in raw.items():
        kind = hints.get(str(name))
        if kind is None or value is None:
            continue
        # a section is a dataclass (or an optional one); a list of sections (reward.terms) is a list, whose items
        # are sections
        options = (kind, *typing.get_args(kind)) if typing.get_origin(kind) is not list else (kind,)
        section = next((option for option in options if is_dataclass(option)), None)
        lists = [option for option in options if option is list or typing.get_origin(option) is list]
        path = f"{prefix}{name}"
        if section is not None:
            if not isinstance(value, dict):
                return f"{path} must be a section (a mapping of keys), got {type(value).__name__} {value!r}"
            found = _container_mismatch(value, section, f"{path}.")
            if found:
                return found
        elif lists and not isinstance(value, list):
            return f"{path} must be a list, got {type(value).__name__} {value!r}"
        elif lists and (item := next(iter(typing.get_args(lists[0])), None)) is not None and is_dataclass(item):
            for index, element in enumerate(value):
                if not isinstance(element, dict):
                    return f"{path}[{index}] must be a section (a mapping of keys), got {type(element).__name__} {element!r}"
                found = _container_mismatch(element, item, f"{path}[{index}].")
                if found:
                    return found
    return None


def _type_at(schema: type, path: list[str]) -> type | None:
    current: Any = schema
    for part in path:
        match = [f for f in fields(current) if f.name == part] if is_dataclass(current) else []
        if not match:
            return None
        current = match[0].default_factory() if callable(match[0].default_factory) else match[0].default  # type: ignore[misc]
        current = type(current)
    return current if is_dataclass(current) else None


def existing_config_file(path: str | Path) -> Path:
    """``path`` as a config file (a missing ``configs/...`` path: the installed preset), or a one-line ConfigError:
    a folder names the YAML files in it, a missing file says so."""
    file = shipped_path(path)
    if file.is_dir():
        presets = sorted(p.name for p in file.glob("*.yaml"))
        listed = ", ".join(presets[:6]) + (", ..." if len(presets) > 6 else "")
        hint = f"give one of its YAML files: {listed}" if presets else "it holds no YAML file"
        raise ConfigError(f"config file {path} is a folder; {hint}")
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist")
    return file


def load_config(schema: type[Schema], path: str | Path | None = None, overrides: list[str] | None = None) -> Schema:
    """Read YAML ``path`` (optional; a missing ``configs/...`` path is the installed preset, see ``shipped_path``),
    apply ``key=value`` overrides, check against ``schema``, return it."""
    path = None if path is None else existing_config_file(path)
    source = str(path) if path else "<defaults>"
    if path is not None:
        raw = read_yaml(path)
        # OmegaConf reads a file with no document (0 bytes, only comments or blank lines, a bare `null`) as {}:
        # every default, a full-size run nobody asked for (a file truncated or not yet written): refused
        if not raw and yaml.safe_load(path.read_text(encoding="utf-8")) is None:
            raise ConfigError(
                f"config file {path} is empty (no settings, only blank lines or comments): refusing to run on the "
                "defaults alone; give a config with settings (e.g. a preset under configs/)"
            )
        if not isinstance(raw, DictConfig):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    else:
        raw = OmegaConf.create({})
    _expand_presets(raw, schema, source)
    for item in overrides or []:
        key, value = _parse_override(item)
        # A section given whole by a preset name or file (model=tiny, sft.model=path.yaml) is that preset: it replaces
        # the section, never merged into what the file had (tiny's shape with another preset's tied embeddings and
        # RoPE scaling would be a model nobody asked for). SECTION.KEY=V (or a {KEY: V} mapping) sets those keys only.
        preset = isinstance(value, str) and takes_preset(_section_at(schema, key.split(".")))
        if preset:
            value = load_preset(value, f"override {item!r}")
        try:
            OmegaConf.update(raw, key, value, merge=not preset, force_add=True)
        except (OmegaConfBaseException, TypeError, ValueError) as error:  # e.g. a mapping given for a list
            raise ConfigError(f"override {item!r}: invalid value for {key}: {one_line(error)}") from error
    if overrides:
        source = f"{source} (with overrides)"
    # A model section is what it says over ModelConfig's declared defaults, as ModelConfig(**keys) would be: not over
    # the schema's default instance, whose derived values (n_kv_heads = its own n_heads, 8) would outlive the keys they
    # derive from (model.n_heads=16 must not become grouped-query attention over 8 heads nobody asked for).
    declared = OmegaConf.create()
    for key, defaults in _preset_sections(schema).items():
        OmegaConf.update(declared, key, defaults, force_add=True)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), declared, raw)
        config = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, TypeError) as error:
        # OmegaConf's merge errors ("Cannot merge incompatible container types") may name no key: find it
        mismatch = _container_mismatch(OmegaConf.to_container(raw, resolve=False), schema)
        if mismatch:
            raise ConfigError(f"{source}: {mismatch}") from error
        if isinstance(error, TypeError):
            raise ConfigError(f"{source}: {one_line(error)}") from error
        raise _explain(error, schema, source) from error
    except ValueError as error:  # a dataclass's own check, e.g. "ModelConfig.dim ..." → "model.dim ..."
        raise ConfigError(f"{source}: {str(error).replace('ModelConfig.', 'model.')}") from error
    check_config(config, source)
    return config  # type: ignore[return-value]


def to_yaml(config: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: Any) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)  # type: ignore[return-value]
