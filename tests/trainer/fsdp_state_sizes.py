"""A rank of tests/trainer/test_plan.py's FSDP2 run (``spawn_ranks(worker, ...)``): FSDP2 over a real model on N
gloo processes (trainer/parallel.py's ``apply_fsdp``, trainer/optim.py's AdamW), one optimizer step, then what each
rank holds locally (its shards of the parameters, gradients and optimizer states) written as JSON to OUT.RANK."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def local_bytes(tensor: torch.Tensor) -> int:
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def worker(rank: int, world: int, preset: str, precision: str, port: str, out: str, overrides: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from models.model import ModelConfig, Transformer
    from trainer.optim import build_optimizer
    from trainer.parallel import apply_fsdp

    torch.manual_seed(0)
    config = ModelConfig.from_preset(preset, **overrides)
    model = Transformer(config)
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    param_dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    apply_fsdp(
        model, init_device_mesh("cpu", (world,)), param_dtype=param_dtype, extra_forward_methods=("token_losses",)
    )
    optimizer, _ = build_optimizer(
        model, lr=1e-3, min_lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=1, max_steps=2
    )
    ids = torch.randint(0, config.vocab_size, (2, 16))
    model.token_losses(ids, ids).sum().backward()
    optimizer.step()
    parameters = list({id(p): p for p in model.parameters()}.values())
    sizes = {
        "parameters": sum(local_bytes(p) for p in parameters),
        "gradients": sum(local_bytes(p.grad) for p in parameters if p.grad is not None),
        "optimizer": sum(
            local_bytes(value)
            for state in optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value)
        ),
    }
    with open(f"{out}.{rank}", "w", encoding="utf-8") as handle:
        json.dump(sizes, handle)
    dist.destroy_process_group()
