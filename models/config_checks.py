"""The one way a config value is refused: a ``ConfigError`` naming the full key path, before any compute.

A field declares what it accepts where it is defined: a range (``bounded``) or a ``Literal`` type. ``check_config``
walks a config's whole tree once, where the config enters (a file through ``load_config``, a model from a
checkpoint or ``--model``), then runs each section's cross-field rule (its
``check_fields(prefix)`` method). ``read_yaml`` is the one reader of a YAML config, and ``shipped_path`` finds the
presets shipped inside the installed package (``configs/``, a top-level package beside ``models/``; the bundled
corpus and tokenizer in ``data/``) with ``importlib.resources``, so a wheel finds them too: a checkout-relative path
(``configs/pretrain/tiny.yaml``) is kept when it exists from the working directory and otherwise answers the
installed copy, so the same commands work after a plain ``pip install .`` from any directory. No torch here:
``trainer.config`` and the CLI read presets through it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import OmegaConf

from models.errors import ConfigError, one_line


@dataclass(frozen=True)
class Range:
    """The numbers a field accepts: finite, and within the bounds given (``ge``/``gt`` below, ``le``/``lt`` above)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def allows(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        below = (self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
        above = (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)
        return not (below or above)

    def __str__(self) -> str:
        low, high = (self.gt, self.ge)[self.gt is None], (self.lt, self.le)[self.lt is None]
        if low is None and high is None:
            return "finite"
        if high is None:
            return f"> {low}" if self.gt is not None else f">= {low}"
        opening, closing = "(" if self.gt is not None else "[", ")" if self.lt is not None else "]"
        return f"in {opening}{low}, {high}{closing}"


def bounded(
    default: Any = MISSING,
    *,
    factory: typing.Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field whose numbers (or each number of its list) must lie in the range given; None passes."""
    metadata = {"range": Range(ge, gt, le, lt)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def range_of(schema: type, key: str) -> Range | None:
    """The range declared for key path ``key`` of config dataclass ``schema`` (``sft.optim.lr``), else None."""
    *sections, name = key.split(".")
    for section in sections:
        schema = _section_type(typing.get_type_hints(schema).get(section))
        if schema is None:
            return None
    found = [item for item in fields(schema) if item.name == name]
    return found[0].metadata.get("range") if found else None


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


def check_config(config: Any, source: str = "", prefix: str = "") -> None:
    """Raise one ``ConfigError`` (after ``source``, the file, when there is one) naming the key path of the first
    field of ``config``, or of a section under it, outside its declared range or choices, or breaking its section's
    cross-field rule."""
    hints = _type_hints(type(config))
    for item in fields(config):
        value, key = getattr(config, item.name), f"{prefix}{item.name}"
        if is_dataclass(value):
            check_config(value, source, f"{key}.")
        elif isinstance(value, list) and value and all(is_dataclass(element) for element in value):
            for index, element in enumerate(value):
                check_config(element, source, f"{key}[{index}].")
        else:
            kind = hints.get(item.name)
            problem = (
                _number_problem(value, kind) or _choice_problem(value, kind)
                or _range_problem(value, item.metadata.get("range"))
            )  # fmt: skip
            if problem:
                where, text = problem
                raise ConfigError(f"{_at(source)}{key}{where} must be {text}")
    check_fields = getattr(config, "check_fields", None)
    if callable(check_fields):
        try:
            check_fields(prefix)
        except ConfigError as error:
            raise ConfigError(f"{_at(source)}{error}") from None


@functools.cache
def _type_hints(schema: type) -> dict[str, Any]:
    """The field types of ``schema``; a field whose annotation does not resolve (a class local to a function) is left
    out: it declares no choices."""
    try:
        return typing.get_type_hints(schema)
    except NameError:
        module = vars(sys.modules.get(schema.__module__, object()))
        hints = {}
        for item in fields(schema):
            with contextlib.suppress(NameError):
                hints[item.name] = eval(item.type, module) if isinstance(item.type, str) else item.type
        return hints


def _choice_problem(value: Any, kind: Any) -> tuple[str, str] | None:
    """For a field typed with ``Literal`` choices (alone, or with bool or None): what is wrong with ``value``."""
    options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    choices = [
        choice for option in options if typing.get_origin(option) is Literal for choice in typing.get_args(option)
    ]
    if not choices or (value in choices and not isinstance(value, bool)):
        return None
    takes_bool, takes_none = bool in options, type(None) in options
    if (takes_bool and isinstance(value, bool)) or (takes_none and value is None):
        return None
    text = f"{', '.join(map(str, choices))}, true or false" if takes_bool else f"one of {', '.join(map(str, choices))}"
    return "", f"{text}, got {value!r}"


def _number_problem(value: Any, kind: Any) -> tuple[str, str] | None:
    """For a field typed ``int`` or ``float`` (or either or None): a value of another type (a config read from JSON
    is not typed by OmegaConf)."""
    options = set(typing.get_args(kind)) if typing.get_origin(kind) in (typing.Union, types.UnionType) else {kind}
    if not options <= {int, float, type(None)} or (value is None and type(None) in options):
        return None
    allowed = (int, float) if float in options else (int,)
    if isinstance(value, allowed) and not isinstance(value, bool):
        return None
    return "", f"{'a number' if float in options else 'an integer'}, got {value!r}"


def _range_problem(value: Any, rule: Range | None) -> tuple[str, str] | None:
    if rule is None or value is None or isinstance(value, bool):
        return None
    for index, element in enumerate(value if isinstance(value, list) else [value]):
        if isinstance(element, (int, float)) and not isinstance(element, bool) and not rule.allows(element):
            return (f"[{index}]" if isinstance(value, list) else ""), f"{rule} but got {element!r}"
    return None


def _section_type(kind: Any) -> type | None:
    options = (kind, *typing.get_args(kind))  # an optional section: X | None
    return next((option for option in options if is_dataclass(option)), None)


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


CONFIG_PACKAGE = "configs"
# top-level packages whose files a checkout-relative path may name (found by name at run time: no code imported)
SHIPPED_PACKAGES = (CONFIG_PACKAGE, "data")


def package_dir(package: str) -> Path:
    """The folder an installed (or checked-out) top-level package's files are in."""
    try:
        root = resources.files(package)
    except ModuleNotFoundError as error:  # e.g. an editable install made before configs/ was a package
        raise ConfigError(f"package {package!r} is not installed: reinstall lantern (pip install -e .)") from error
    if not isinstance(root, Path):  # imported from a zip: OmegaConf and tiktoken need real files
        raise ConfigError(f"package {package!r} is not installed as plain files ({root}): reinstall lantern with pip")
    return root


def shipped_path(path: str | Path) -> Path:
    """``path`` itself when it exists, is absolute, or names no shipped package; else, for a relative path such as
    ``configs/pretrain/tiny.yaml``, the installed copy when there is one (else ``path``, for the caller's error)."""
    path = Path(path)
    if path.exists() or path.is_absolute() or len(path.parts) < 2 or path.parts[0] not in SHIPPED_PACKAGES:
        return path
    packaged = package_dir(path.parts[0]).joinpath(*path.parts[1:])
    return packaged if packaged.exists() else path


def model_preset_path(name: str) -> Path:
    """The YAML file of model preset ``name`` (``configs/model/NAME.yaml``), or ``name`` itself when it is a path
    to a YAML file (checkout-relative ones resolved as ``shipped_path`` does). It may not exist."""
    if str(name).endswith((".yaml", ".yml")):
        return shipped_path(name)
    return package_dir(CONFIG_PACKAGE) / "model" / f"{name}.yaml"


def model_presets() -> list[str]:
    """Names of the shipped model presets, for "not found" messages."""
    return sorted(path.stem for path in (package_dir(CONFIG_PACKAGE) / "model").glob("*.yaml"))
