"""Consolidate a training checkpoint (a .ckpt file, or FSDP2's folder of per-rank shards) into one model folder that
``load_checkpoint``, ``lantern convert`` and other tools read.

A LoRA checkpoint holds only the adapters and a record of its base; its export rebuilds that base, refuses one whose
fingerprint differs, and writes either the model with the adapters folded in (the default) or the Hugging Face base
beside the adapter in peft's format (``adapter=True``: ``OUT/base`` and ``OUT/adapter``).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint
from torch.distributed.checkpoint.api import CheckpointException

from data.tokenizer.convert import hf_export_files, hf_tokenizer_folder, with_hf_tokenizer_files
from data.tokenizer.tokenizer import Tokenizer
from models.adapters import add_adapters, base_fingerprint, lora_config, merge_adapters, trained_names
from models.errors import CheckpointError, one_line
from models.files.atomic import IfExists, atomic_directory, check_destination
from models.formats.checkpoint import export_hf, load_checkpoint, load_model_config, save_checkpoint, write_hf_folder
from models.formats.checkpoint_io import read_torch_file
from models.formats.gguf_format import check_gguf_destination, write_gguf
from models.formats.hf_format import native_to_hf_adapter_state, write_hf_adapter
from models.model import ModelConfig, Transformer
from models.model_config import HF_TARGETS, PeftConfig, lantern_targets
from trainer.parallel import plain_name

log = logging.getLogger(__name__)

ExportFormat = Literal["native", "hf", "gguf"]


def read_training_checkpoint(path: str | Path) -> dict[str, Any]:
    """The whole training checkpoint as one dict on CPU, without a process group (weights_only loading)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"training checkpoint {path} does not exist")
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise ValueError(f"{path} is a folder but not a sharded (torch.distributed.checkpoint) checkpoint")
        try:
            checkpoint = _load_distributed_checkpoint(path)
        # torch.distributed.checkpoint's errors are multi-line tracebacks of ranks (CheckpointException is
        # a BaseException); the first line says what failed
        except (CheckpointException, RuntimeError, ValueError, OSError, KeyError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"{path}: unreadable sharded checkpoint ({first})") from None
        checkpoint.update(read_torch_file(path / _METADATA_FILENAME))
        return checkpoint
    checkpoint = read_torch_file(path)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path}: not a training checkpoint (holds a {type(checkpoint).__name__}, not a dict)")
    return checkpoint


def lantern_config(checkpoint: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    """The Lantern config a training checkpoint (its dict, or its header alone) was written with."""
    try:
        return checkpoint["hyper_parameters"]["config"]
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"{path} holds no Lantern config (hyper_parameters.config): not a Lantern checkpoint"
        ) from error


def recorded_tokenizer(config: Mapping[str, Any]) -> str | None:
    """The tokenizer spec a training run's config recorded (``data.tokenizer``; RL stages: ``tokenizer``)."""
    return (config.get("data") or {}).get("tokenizer") or config.get("tokenizer")


def export_training_checkpoint(
    path: str | Path,
    out: str | Path,
    *,
    prefix: str = "model.",
    overwrite: bool = False,
    format: ExportFormat = "native",
    adapter: bool = False,
    gguf_dtype: str = "f16",
) -> Path:
    """Write the ``prefix``-ed submodule of a training checkpoint (the LM by default) as a native folder, or a
    Hugging Face one (``format="hf"``, with tokenizer.json even for a tiktoken tokenizer), or a GGUF file
    (``format="gguf"``, in ``gguf_dtype``). A checkpoint with LoRA adapters is written merged, or, with ``adapter``, as
    ``out/base`` (the Hugging Face base) and ``out/adapter`` (peft's adapter folder); ``adapter`` on a checkpoint
    without adapters is refused. A non-empty ``out`` is refused unless ``overwrite``; one that is or contains
    ``path``, always (both checked before anything is read). A full or read-only disk is a one-line ``StorageError``
    naming ``out``, with nothing half-written left (the writers' own atomic folder or file)."""
    if_exists: IfExists = "replace" if overwrite else "refuse"
    if format == "gguf":
        check_gguf_destination(out, overwrite=overwrite, sources=(path,))
    else:
        check_destination(out, if_exists=if_exists, sources=(path,))
    model, tokenizer, metadata, record = training_checkpoint_model(path, prefix, merge=not adapter)
    if record is None and adapter:
        raise CheckpointError(
            f"{path} holds a fully trained model, not LoRA adapters (peft.kind was none): --adapter applies "
            "to an adapter checkpoint only; export it without --adapter"
        )
    with tempfile.TemporaryDirectory() as scratch:
        if format == "gguf":
            return write_gguf(
                model, out, hf_tokenizer_folder(tokenizer, scratch), dtype=gguf_dtype, overwrite=overwrite
            )
        files = _tokenizer_files(tokenizer, hf=format == "hf" or adapter, scratch=scratch)
        if adapter:
            return _write_adapter(path, model, out, files, if_exists)
        if format == "hf":
            return export_hf(model, out, tokenizer_path=files, if_exists=if_exists)
        return save_checkpoint(
            model, out, tokenizer_path=files, metadata=metadata, if_exists=if_exists, sources=(path,)
        )


def training_checkpoint_model(
    path: str | Path, prefix: str = "model.", *, merge: bool = True
) -> tuple[Transformer, str | None, dict[str, Any], Mapping[str, Any] | None]:
    """The ``prefix``-ed model of a training checkpoint on CPU, its tokenizer spec, metadata for an export, and its
    LoRA record (None without adapters); with ``merge``, adapters are folded into their base."""
    checkpoint = read_training_checkpoint(path)
    config = lantern_config(checkpoint, path)
    state = {
        plain_name(name[len(prefix) :]): tensor
        for name, tensor in checkpoint["state_dict"].items()
        if name.startswith(prefix)
    }
    if any(name.startswith("head.") for name in state):
        raise CheckpointError(
            f"{path} is a reward model's checkpoint (a backbone and a score head), not a language model's: the "
            "run's final/ folder is its exported reward model (PPO and the report read it there)"
        )
    tokenizer = recorded_tokenizer(config)
    metadata: dict[str, Any] = {"step": checkpoint.get("global_step"), "exported_from": str(path)}
    record = (checkpoint.get("adapters") or {}).get(prefix.removesuffix("."))
    if record is None:
        return _plain_model(path, state, _recorded_model(config, path)), tokenizer, metadata, None
    model = model_with_adapters(path, record, state)
    if merge:
        merge_adapters(model)
        metadata["merged_adapters"] = {k: record.get(k) for k in ("checkpoint", "seed", "fingerprint", "peft")}
        log.info("LoRA adapters of %s merged into their base %s", path, _base_name(record))
    return model, tokenizer, metadata, record


def _recorded_model(config: Mapping[str, Any], path: str | Path) -> ModelConfig:
    """The model a run's config records: its model section, or (RL stages, which have none) the config of the
    policy folder it started from."""
    if "model" in config:
        return ModelConfig.from_dict(config["model"])
    policy = (config.get("init") or {}).get("policy")
    if not policy:
        raise CheckpointError(f"{path}: its config records no model (no model section, no init.policy)")
    try:
        return load_model_config(policy)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{path}: its model is that of init.policy, {policy}, which cannot be read now ({one_line(error)}): "
            "put that folder back to export this checkpoint"
        ) from None


def _plain_model(path: str | Path, state: dict[str, torch.Tensor], model_config: ModelConfig) -> Transformer:
    """The model of a checkpoint that holds every weight."""
    with torch.device("meta"):
        model = Transformer(model_config)
    missing, unexpected = model.load_state_dict(state, assign=True, strict=False)
    missing = [name for name in missing if not (name == "output.weight" and model_config.tie_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config: missing {missing}, unexpected {unexpected}")
    if model_config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


def _tokenizer_files(spec: str | None, *, hf: bool, scratch: str) -> dict[str, Path]:
    """The files of the tokenizer the run trained with (copied into the export), with a tiktoken rank file's
    tokenizer.json converted in ``scratch`` (``with_hf_tokenizer_files``); for a Hugging Face folder (``hf``), a named
    encoding's (cl100k_base) too (``hf_export_files``). None for a named encoding in a native folder (its config
    names it) or a tokenizer that is gone."""
    if not spec:
        return {}
    if hf:
        return hf_export_files(spec, scratch)
    try:
        return with_hf_tokenizer_files(Tokenizer.load(spec).files, scratch)
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------------------
# checkpoints with adapters


def _base_name(record: Mapping[str, Any]) -> str:
    return str(record["checkpoint"]) if record.get("checkpoint") else f"(a model seeded with {record.get('seed')})"


def rebuild_base(path: str | Path, record: Mapping[str, Any]) -> Transformer:
    """The base an adapter checkpoint (``path``) records, as training had it: its folder read in fp32, or the model
    built right after seeding; refused in one line when the folder is gone, does not load, or holds another model
    than the one the adapters were trained on (its fingerprint, or its config, differs)."""
    folder = record.get("checkpoint")
    name = _base_name(record)
    if folder:
        if not Path(folder).exists():
            raise CheckpointError(
                f"{path}: its LoRA adapters were trained on base {folder}, which no longer exists: put that base "
                "back there to export them"
            )
        try:
            base = load_checkpoint(folder, dtype=torch.float32)
        except (OSError, ValueError) as error:
            raise CheckpointError(
                f"{path}: its LoRA adapters' base {folder} does not load ({one_line(error)})"
            ) from None
    else:
        with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
            torch.manual_seed(record["seed"])
            base = Transformer(ModelConfig.from_dict(record["model"]))
    fingerprint = base_fingerprint(base)
    if fingerprint != record["fingerprint"]:
        raise CheckpointError(
            f"{path}: its LoRA adapters were trained on base {name} (fingerprint {record['fingerprint']}), which "
            f"now holds another model (fingerprint {fingerprint}): export with the base they were trained on"
        )
    recorded = record.get("model")
    if recorded is not None and ModelConfig.from_dict(recorded) != base.config:
        current = base.config.to_dict()
        changed = [
            f"{key} {recorded.get(key)!r} -> {current.get(key)!r}"
            for key in current
            if recorded.get(key) != current.get(key)
        ]
        raise CheckpointError(
            f"{path}: its LoRA adapters were trained on base {name}, whose model config has changed since "
            f"({'; '.join(changed)}): export with the base they were trained on"
        )
    return base


def model_with_adapters(path: str | Path, record: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> Transformer:
    """The rebuilt base (``rebuild_base``) with the recorded adapters, loaded with the checkpoint's trained tensors
    (``state``, plain names); every trained tensor must be there, and nothing else."""
    model = rebuild_base(path, record)
    peft = PeftConfig(**record["peft"])
    add_adapters(model, peft)
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    trained = trained_names(model)
    missing = [name for name in missing if name in trained]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: its tensors do not match its LoRA adapters (peft {record['peft']}): missing {missing[:3]}, "
            f"unexpected {unexpected[:3]} ({len(missing)} and {len(unexpected)} in all)"
        )
    return model


def _base_model(model: Transformer) -> Transformer:
    """The base weights of a model with adapters, as a plain ``Transformer`` sharing them (no copy)."""
    state = {
        name.replace(".base_layer.", "."): tensor for name, tensor in model.state_dict().items() if "lora_" not in name
    }
    with torch.device("meta"):
        base = Transformer(model.config)
    base.load_state_dict(state, assign=True, strict=True)
    if model.config.tie_embeddings:
        base.output.weight = base.tok_embeddings.weight
    return base


def _write_adapter(
    path: str | Path, model: Transformer, out: str | Path, tokenizer_files: dict[str, Path], if_exists: IfExists
) -> Path:
    """``out/base``: the Hugging Face export of the base; ``out/adapter``: the adapters in peft's format for it
    (Hugging Face module names, ``base_model_name_or_path`` the absolute ``out/base``, so that
    ``AutoPeftModelForCausalLM.from_pretrained(out/adapter)`` finds it; ``PeftModel.from_pretrained`` takes any base)."""
    peft = model.adapter_config
    to_hf = {native: hf for hf, native in HF_TARGETS.items()}
    targets = [to_hf[name] for name in lantern_targets(peft)]
    lora = lora_config(peft, targets=targets)
    lora.target_modules = targets  # in order (peft keeps a set, which adapter_config.json would list in any order)
    lora.task_type = "CAUSAL_LM"
    target = Path(out).absolute()
    lora.base_model_name_or_path = str(target / "base")
    adapters = {name: tensor for name, tensor in model.state_dict().items() if "lora_" in name}
    # both halves inside one atomic folder: a failing disk is one line naming ``out`` and leaves neither
    with atomic_directory(target, if_exists=if_exists, sources=(path,), what="adapter export") as tmp:
        write_hf_folder(_base_model(model), tmp / "base", tokenizer_path=tokenizer_files)
        write_hf_adapter(native_to_hf_adapter_state(adapters, model.config), lora, tmp / "adapter")
    return target
