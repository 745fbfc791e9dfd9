"""``bench_lora params``: trainable parameters and the bytes of weights, gradients and AdamW's moments for LoRA and
for full fine-tuning, counted exactly on a model built on the meta device (tied embeddings once)."""

from __future__ import annotations

import argparse
from typing import Any

GIB, MIB = 2**30, 2**20


def unique_parameters(model) -> list:
    seen, params = set(), []
    for parameter in model.parameters():
        if id(parameter) not in seen:  # a tied embedding is one tensor under two names
            seen.add(id(parameter))
            params.append(parameter)
    return params


def count_preset(preset: str | dict, rank: int, alpha: float) -> dict[str, Any]:
    """Parameters and training-state bytes of full fine-tuning and of LoRA, for a preset name or a model dict."""
    import torch

    from models.adapters import add_adapters
    from models.model import ModelConfig, Transformer
    from models.model_config import PeftConfig

    config = ModelConfig.from_dict(preset) if isinstance(preset, dict) else ModelConfig.from_preset(preset)
    with torch.device("meta"):
        model = Transformer(config)
        base = sum(p.numel() for p in unique_parameters(model))
        add_adapters(model, PeftConfig(kind="lora", rank=rank, alpha=alpha))
    params = unique_parameters(model)
    lora = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    assert frozen == base, (frozen, base)
    fp32, bf16 = 4, 2
    full = {"weights": fp32 * base, "grads": fp32 * base, "adam": 2 * fp32 * base}
    adapters = {
        "weights": fp32 * (base + lora),
        "grads": fp32 * lora,
        "adam": 2 * fp32 * lora,
        "weights_bf16_base": bf16 * base + fp32 * lora,
    }
    full["total"] = full["weights"] + full["grads"] + full["adam"]
    adapters["total"] = adapters["weights"] + adapters["grads"] + adapters["adam"]
    adapters["total_bf16_base"] = adapters["weights_bf16_base"] + adapters["grads"] + adapters["adam"]
    return {
        "preset": preset if isinstance(preset, str) else "model",
        "tie_embeddings": config.tie_embeddings,
        "base_params": base,
        "lora_params": lora,
        "trainable_pct": 100 * lora / base,
        "full_bytes": full,
        "lora_bytes": adapters,
        # gradients + AdamW moments: what exists only for trained parameters
        "grad_adam_pct_of_full": 100 * (adapters["grads"] + adapters["adam"]) / (full["grads"] + full["adam"]),
        "total_pct_of_full": 100 * adapters["total"] / full["total"],
        "total_bf16_base_pct_of_full": 100 * adapters["total_bf16_base"] / full["total"],
    }


def run_params(args: argparse.Namespace) -> dict[str, Any]:
    rows = [count_preset(preset, args.rank, args.alpha) for preset in args.presets]
    print(f"LoRA r={args.rank} (alpha {args.alpha:g}) on wq wk wv wo w1 w2 w3 vs full fine-tuning; fp32 weights, "
          "fp32 gradients, 2 fp32 AdamW moments (bf16 base: LoRA's frozen base in bf16)")  # fmt: skip
    head = (
        f"{'preset':<13}{'params':>15}{'LoRA params':>13}{'trained':>9}{'grad+Adam full':>16}{'grad+Adam LoRA':>16}"
        f"{'LoRA/full':>10}{'state full':>12}{'state LoRA':>12}{'(bf16 base)':>12}"
    )
    print(head)
    for r in rows:
        full, lora = r["full_bytes"], r["lora_bytes"]
        print(
            f"{r['preset']:<13}{r['base_params']:>15,}{r['lora_params']:>13,}{r['trainable_pct']:>8.2f}%"
            f"{size(full['grads'] + full['adam']):>16}{size(lora['grads'] + lora['adam']):>16}"
            f"{r['grad_adam_pct_of_full']:>9.2f}%{size(full['total']):>12}{size(lora['total']):>12}"
            f"{size(lora['total_bf16_base']):>12}"
        )
    return {"rank": args.rank, "alpha": args.alpha, "targets": "wq wk wv wo w1 w2 w3", "presets": rows}


def size(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.1f} MiB"
