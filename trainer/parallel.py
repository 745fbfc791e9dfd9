"""Parallelism applied from outside the model, in torchtitan's order: activation checkpointing, ``torch.compile`` per
block, then FSDP2 ``fully_shard`` per block and at the root; gradient norms and clipping over ranks; the FSDP2
strategy that resumes adapters-only checkpoints. Checkpoints never carry the wrappers' name prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from models.errors import CheckpointError
from trainer.stopping import StopTogether


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The block list of a Transformer, or of the backbone of a ScalarModel (reward model, critic)."""
    return model.layers if hasattr(model, "layers") else model.backbone.layers


def apply_activation_checkpointing(model: nn.Module, mode: Literal["none", "full", "selective"], every: int = 2) -> int:
    """Recompute block activations in backward: every block (``full``) or every ``every``-th (``selective``);
    returns the number of wrapped blocks."""
    if mode == "none":
        return 0
    wrapped = 0
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        if mode == "full" or index % every == 0:
            # a block that draws random numbers (LoRA's dropout) must redraw the same ones when recomputed, or its
            # gradients are those of another forward; one without (the plain model) skips saving the RNG state
            draws = any(isinstance(module, nn.Dropout) and module.p > 0 for module in block.modules())
            blocks[index] = checkpoint_wrapper(block, preserve_rng_state=draws)
            wrapped += 1
    return wrapped


def apply_compile(model: nn.Module) -> None:
    """Compile each block separately: identical blocks share one compiled graph and compile time stays flat."""
    blocks = transformer_blocks(model)
    for index, block in enumerate(blocks):
        blocks[index] = torch.compile(block, fullgraph=True)


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    extra_forward_methods: tuple[str, ...] = (),
) -> None:
    """FSDP2: shard each block, then the root; ``extra_forward_methods`` (``token_losses``) unshard the root as
    ``forward`` does."""
    kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = transformer_blocks(model)
    last = len(blocks) - 1
    for index, block in enumerate(blocks):
        # The last block's parameters are needed right away by backward: resharding them after forward
        # would only gather them again.
        fully_shard(block, reshard_after_forward=index < last, **kwargs)
    fully_shard(model, **kwargs)
    for method in extra_forward_methods:
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)


def configure_parallelism(model: nn.Module, trainer, config) -> None:
    """Apply ``config``'s (a TrainerConfig) activation checkpointing, compile and (under ``fsdp``) FSDP2 to
    ``model``; a second call does nothing."""
    if getattr(model, "_lantern_parallelized", False):
        return
    is_meta = any(p.is_meta for p in model.parameters())
    if config.precision == "bf16-true" and not is_meta:
        model.to(torch.bfloat16)  # before sharding: FSDP2 then shards bf16 parameters
    apply_activation_checkpointing(model, config.activation_checkpointing, config.ac_every)
    # trainer.compile is true or false once prepare_trainer resolved it; auto (a config never checked) is on CUDA
    if config.compile is True or (config.compile == "auto" and trainer.strategy.root_device.type == "cuda"):
        apply_compile(model)
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        apply_fsdp(
            model,
            strategy.device_mesh["data_parallel"],
            param_dtype=torch.bfloat16 if config.precision == "bf16-mixed" else None,
            reduce_dtype=torch.float32,
            cpu_offload=config.cpu_offload,
            extra_forward_methods=("token_losses", "hidden_states"),
        )
    if is_meta:
        model.to_empty(device=strategy.root_device)
        with torch.no_grad():
            model.init_weights()
        if config.precision == "bf16-true":
            model.to(torch.bfloat16)
    model._lantern_parallelized = True


def grad_norm_and_clip(parameters, max_norm: float | None) -> torch.Tensor:
    """Total gradient norm over all ranks (also for FSDP2's sharded DTensor gradients), clipped when asked."""
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.zeros(())
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor: the partial norms are reduced across ranks here
        norm = norm.full_tensor()
    return norm.detach()


@contextmanager
def unsharded_for_generation(model: nn.Module) -> Iterator[None]:
    """Gather FSDP2-sharded weights once for a whole generation (inside, forwards run no collectives, so ranks may
    generate different numbers of tokens); a no-op for a model not sharded, and inside another such block."""
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not sharded or getattr(model, "_lantern_unsharded", False):  # not sharded, or already gathered by a caller
        yield
        return
    if isinstance(model, FSDPModule):
        # FSDP2 decides at lazy init (normally the root's first forward) that the root keeps its weights after
        # forward; before that its param group still reads "reshard", which the finally block below would then
        # set for good. Run the lazy init now (a no-op once done), then read the settings.
        model._get_fsdp_state()._lazy_init()
    # FSDP2 has no public getter for reshard_after_forward; its param group keeps a post-forward mesh
    # exactly when it reshards after forward.
    reshards = [module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for module in sharded]
    for module in sharded:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    model._lantern_unsharded = True
    try:
        yield
    finally:
        model._lantern_unsharded = False
        for module, reshard in zip(sharded, reshards):
            module.reshard()
            module.set_reshard_after_forward(reshard, recurse=False)


WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def plain_name(name: str) -> str:
    """A parameter's name with the prefixes that compile, activation checkpointing and FSDP wrappers add
    removed: the name checkpoints carry, whatever wraps the model."""
    for wrapper in WRAPPER_PREFIXES:
        name = name.replace(wrapper, "")
    return name


class FSDP2Strategy(StopTogether, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) that also resumes a sharded checkpoint holding only what trained
    (LoRA adapters): the load is narrowed to the checkpoint's tensors once the module has checked its base."""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        module = self.lightning_module
        path = Path(self.broadcast(checkpoint_path))
        if not (path / _METADATA_FILENAME).is_file():  # a single file (a single process's): Lightning's own load
            if path.is_file() and torch.load(path, mmap=True, map_location="cpu", weights_only=True).get("adapters"):
                # Lightning would look for the base's tensors in it (a traceback), or skip the adapters' wrapped names
                raise CheckpointError(
                    f"{path} holds LoRA adapters trained by a single process: resume it with trainer.strategy=single "
                    "(an FSDP run resumes its own sharded checkpoint folders)"
                )
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        metadata = torch.load(path / _METADATA_FILENAME, weights_only=True)
        # before any tensor: an adapters' checkpoint resumed without them (or onto another base) fails in one line,
        # not in DCP's search for the base's tensors
        if hasattr(module, "check_adapter_checkpoint"):
            module.check_adapter_checkpoint(metadata, path)
        if not getattr(module, "adapter_bases", None):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys()
        model_state = {
            name: tensor for name, tensor in get_model_state_dict(self.model).items() if f"state_dict.{name}" in saved
        }
        dcp.load({"state_dict": model_state}, checkpoint_id=path)
        module.load_state_dict(model_state, strict=module.strict_loading)
        for index, optimizer in enumerate(self.optimizers):
            optimizer_state = {f"optimizer_{index}": get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(optimizer_state, checkpoint_id=path)
            set_optimizer_state_dict(
                self.model,
                optimizer,
                optim_state_dict=optimizer_state[f"optimizer_{index}"],
                options=StateDictOptions(cpu_offload=True),
            )
        return metadata


def first_non_finite(tensors: list[torch.Tensor], trainer: Any) -> int | None:
    """The index of the first of ``tensors`` holding a NaN/Inf on any rank, or None: every rank passes the same
    list in the same order and gets the same answer (one host read; one all-reduce under several ranks, so no rank
    raises or skips while the others wait in a collective)."""
    finite = torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).float()
    if trainer.world_size > 1:
        finite = trainer.strategy.reduce(finite, reduce_op="min")
    flags = finite.tolist()
    return None if min(flags) >= 1 else flags.index(min(flags))
