"""``lantern convert``: a model folder or GGUF file into a native, Hugging Face or GGUF one, with its tokenizer. Parses,
picks the path and reports; torch is imported only when the command runs, so ``lantern --help`` stays light.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

from models.errors import LanternError

DTYPES = ("float32", "float16", "bfloat16")
GGUF_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def add_convert_command(commands: Any) -> None:
    """``lantern convert --from FORMAT SRC --to FORMAT DST [--dtype D] [--overwrite]`` on ``commands``."""
    convert = commands.add_parser("convert", help="convert checkpoints between formats (native, hf, meta, gguf)")
    convert.add_argument(
        "--from",
        dest="src_format",
        choices=["auto", "hf", "meta", "native", "gguf"],
        default="auto",
        help="auto: a .gguf file is GGUF, a folder is detected by its files",
    )
    convert.add_argument("src", help="source checkpoint folder, or a .gguf file")
    convert.add_argument("--to", dest="dst_format", choices=["hf", "native", "gguf"], required=True)
    convert.add_argument(
        "dst", help="destination folder (a .gguf file for --to gguf; empty or new, unless --overwrite)"
    )
    convert.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weights' dtype in DST (default: the source's; a GGUF source is dequantized to float32; GGUF output "
        "defaults to float16)",
    )
    convert.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty destination (never one that contains the source)"
    )
    convert.set_defaults(handler=_convert)


def _convert(args: argparse.Namespace) -> None:
    import torch

    from models.files.atomic import StorageError

    src_format = "gguf" if args.src_format == "auto" and str(args.src).endswith(".gguf") else args.src_format
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if src_format == "gguf" and args.dst_format == "gguf":
        raise LanternError(f"{args.src} is already a GGUF file")
    try:
        if src_format == "gguf":
            from models.formats.gguf_format import convert_gguf

            out = convert_gguf(args.src, args.dst, args.dst_format, dtype=dtype, overwrite=args.overwrite)
        elif args.dst_format == "gguf":
            out = _to_gguf(args.src, src_format, args.dst, args.dtype or "float16", args.overwrite)
        else:
            out = _between_folders(args.src, src_format, args.dst, args.dst_format, dtype, args.overwrite)
    except (FileExistsError, StorageError) as error:  # the destination refused or the disk failed: one line
        raise LanternError(str(error)) from error
    print(f"wrote {args.dst_format} checkpoint to {out}")


def _between_folders(src: str, src_format: str, dst: str, dst_format: str, dtype: Any, overwrite: bool) -> Any:
    from pathlib import Path

    from data.tokenizer.convert import hf_export_files, with_hf_tokenizer_files
    from models.formats.checkpoint import convert
    from models.formats.tokenizer_files import tokenizer_files_in

    with tempfile.TemporaryDirectory() as scratch:
        # both folders carry tokenizer.json even when the model was trained with a tiktoken file, so transformers'
        # AutoTokenizer loads them as they are; a native folder also keeps the source's rank file (a Hugging Face
        # folder's original/tokenizer.model too) at its top, where Lantern reads it first
        folder = Path(src) if Path(src).is_dir() else Path(src).parent
        if dst_format == "hf":
            tokenizer = hf_export_files(src, scratch)
        else:
            tokenizer = with_hf_tokenizer_files(tokenizer_files_in(folder), scratch)
        return convert(
            src=src,
            src_format=src_format,
            dst=dst,
            dst_format=dst_format,
            dtype=dtype,
            overwrite=overwrite,
            tokenizer_path=tokenizer,
        )


def _to_gguf(src: str, src_format: str, dst: str, dtype: str, overwrite: bool) -> Any:
    from data.tokenizer.convert import hf_tokenizer_folder
    from models.formats.checkpoint import load_checkpoint
    from models.formats.gguf_format import check_gguf_destination, write_gguf

    check_gguf_destination(dst, overwrite=overwrite, sources=(src,))
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = hf_tokenizer_folder(src, scratch)  # before the weights are read: a folder without one is refused
        model = load_checkpoint(src, format=src_format)
        return write_gguf(model, dst, tokenizer, dtype=GGUF_DTYPES[dtype], overwrite=overwrite)
