"""The models a stage config names, as model configs (no weights): its own folders' configs, a preset, or the model
given for every path (``lantern plan --model``), by the roles the stage record declares; what ``lantern plan`` and a
stage's pre-flight plan read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from alignment.shared.stage_plan import Models
from models.config_checks import model_preset_path
from models.errors import ConfigError
from models.model_config import InvalidModelConfig, ModelConfig
from trainer.config import load_preset
from trainer.model_sources import source_model_config


def model_named(name: str) -> ModelConfig:
    """``--model``: a preset (llama3.2-1b), a model YAML, or a model source (a folder, a GGUF file, a training
    checkpoint); its sizes within bounds (``ModelConfig`` checks its declared ranges where it is made)."""
    folder = Path(name).expanduser()
    if folder.is_dir() or (folder.suffix in (".gguf", ".ckpt") and folder.is_file()):
        return folder_model(folder, f"--model {name}")
    if not model_preset_path(name).is_file():
        raise ConfigError(f"--model {name!r} is neither a model preset, a model YAML nor a checkpoint folder")
    try:  # read as a stage config's model=NAME is: one loader, one-line errors
        config = ModelConfig.from_dict(OmegaConf.to_container(load_preset(name, f"--model {name}"), resolve=True))
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"--model {name}: {str(error).replace('ModelConfig.', 'model.')}") from error
    return config


def folder_model(folder: Path, key: str) -> ModelConfig:
    """The model config of a model source (a checkpoint folder, a GGUF file, a training checkpoint), its sizes within
    bounds (a planned model is built on the meta device, one module per layer: an absurd size is refused, not built)."""
    try:
        return source_model_config(folder)
    except InvalidModelConfig as error:  # read, and refused by its own declared ranges
        raise ConfigError(f"{key} ({folder}): {str(error).replace('ModelConfig.', 'model.')}") from error
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {folder} holds no readable model config ({error})") from error


class ModelResolver:
    """The model config a path in a stage config stands for: ``--model`` when given, a model planned upstream (the
    pipeline's), the folder's own config, else a one-line error asking for ``--model``."""

    def __init__(self, model: str | None, known: dict[str, ModelConfig] | None = None) -> None:
        self.model = model_named(model) if model else None
        self.known = known or {}

    def __call__(self, path: str | None, key: str, fallback: ModelConfig | None = None) -> ModelConfig:
        if self.model is not None:
            return self.model
        if path:
            if str(path) in self.known:
                return self.known[str(path)]
            if Path(path).expanduser().exists():
                return folder_model(Path(path).expanduser(), key)
            raise ConfigError(
                f"{key}: {path} does not exist (yet): name the model to plan with --model (a preset such as "
                "llama3.2-1b, a model YAML or a checkpoint folder)"
            )
        if fallback is None:
            raise ConfigError(f"{key} is not set: name the model to plan with --model")
        return fallback


def stage_models(stage: Any, config: Any, resolve: ModelResolver) -> Models:
    """The models ``config`` names, by the roles its stage record declares (``Stage.models``): the one it starts
    from (unset: its ``model`` section, as pretraining's and a seeded SFT's), the reference, the reward models that
    score its samples, the critic (the first of its critic roles that applies and is set), and any other role by
    its name."""
    fallback = getattr(config, "model", None)
    start = stage.start_role
    folders = start.folders(config) if start else []
    policy = resolve(folders[0][0] if folders else None, start.key if start else "model", fallback)
    models = Models(policy)
    for role in stage.models:
        if role is start or not role.applies(config):
            continue
        found = [resolve(folder, key) for folder, key in role.folders(config)]
        if role.role == "reference":
            models.reference = models.reference or (found[0] if found else None)
        elif role.role == "reward model":
            models.rewards += found
        elif role.role == "critic":
            models.critic = models.critic or (found[0] if found else None)
        elif found:
            models.others.setdefault(role.role, []).extend(found)
    return models
