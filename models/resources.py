"""Files shipped inside the installed package, found with ``importlib.resources`` so a wheel finds them too.

``configs/`` (model presets and stage presets, YAML) is a top-level package beside ``models/``; the bundled
corpus and tokenizer ship inside ``data/`` (``data/corpus/``, ``data/assets/``). The README and the presets
write such files as paths from the checkout (``configs/pretrain/tiny.yaml``, ``data/corpus/tinyshakespeare.txt``).
``shipped_path`` keeps such a path when it exists from the working directory (a checkout, or the user's own
file of that name) and otherwise answers the installed copy, so the same commands work after a plain
``pip install .`` from any directory. No torch here: ``trainer.config`` and the CLI read presets through it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from models.errors import ConfigError

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
