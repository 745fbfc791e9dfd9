"""``lantern export``: a training checkpoint (a .ckpt file or a sharded folder) into a native or Hugging Face model
folder, LoRA adapters merged or kept apart in peft's format. Parses and reports; torch is imported only when the
command runs, so ``lantern --help`` stays light.
"""

from __future__ import annotations

import argparse
from typing import Any

from models.errors import LanternError


def add_export_command(commands: Any) -> None:
    """``lantern export CHECKPOINT OUT [--format native|hf] [--merge|--adapter] [--overwrite]`` on ``commands``."""
    export = commands.add_parser(
        "export", help="turn a training checkpoint (.ckpt file or sharded folder) into a model folder"
    )
    export.add_argument("checkpoint")
    export.add_argument("out", help="destination folder (empty or new, unless --overwrite)")
    export.add_argument(
        "--format",
        choices=["native", "hf", "gguf"],
        default=None,
        help="native (default: a Hugging Face folder of the model's family that transformers loads as it is, plus "
        "Lantern's lantern.json), hf (the Hugging Face folder alone: a tiktoken rank file under original/, as in "
        "Meta's repos), or gguf (OUT is then a .gguf file, for llama.cpp, Ollama and transformers' GGUF loader)",
    )
    export.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float16",
        help="the GGUF file's weights (default float16; native and Hugging Face exports keep the checkpoint's)",
    )
    adapters = export.add_mutually_exclusive_group()
    adapters.add_argument(
        "--merge",
        action="store_true",
        help="LoRA adapters folded into the weights: one plain model (the default; a no-op without adapters)",
    )
    adapters.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA adapters kept apart: OUT/base (Hugging Face) and OUT/adapter (peft's adapter_config.json and "
        "adapter_model.safetensors)",
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty destination (never one that contains the checkpoint)",
    )
    export.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> None:
    from models.files.atomic import StorageError
    from trainer.export import export_training_checkpoint

    if args.adapter and args.format == "native":
        raise LanternError(
            "--adapter writes a Hugging Face base (OUT/base) and a peft adapter (OUT/adapter): drop --format native, "
            "or use --merge for a native model"
        )
    fmt = args.format or "native"
    if args.adapter and fmt == "gguf":
        raise LanternError("--adapter writes a peft adapter beside a Hugging Face base: drop --format gguf")
    gguf_dtype = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[args.dtype]
    try:
        out = export_training_checkpoint(
            args.checkpoint, args.out, overwrite=args.overwrite, format=fmt, adapter=args.adapter, gguf_dtype=gguf_dtype
        )
    except (FileExistsError, StorageError) as error:  # the destination refused or the disk failed: one line
        raise LanternError(str(error)) from error
    if args.adapter:
        print(f"wrote the Hugging Face base to {out / 'base'} and its LoRA adapter (peft) to {out / 'adapter'}")
    else:
        print(f"wrote {dict(hf='Hugging Face', gguf='GGUF').get(fmt, 'native')} checkpoint to {out}")
