"""The ``lantern`` command: one sub-command per stage, the same flags style for each.

Heavy imports (torch, datasets, lightning) happen inside the handlers so ``lantern --help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("lantern")


def _tokenizer_train(args: argparse.Namespace) -> None:
    from data.bpe import train_bpe

    out = train_bpe(corpus=args.corpus, vocab_size=args.vocab_size, out=args.out)
    print(f"wrote tokenizer ({args.vocab_size} tokens incl. specials) to {out}")


def _load_model_for_generation(args: argparse.Namespace):
    import torch

    from models.checkpoint import load_checkpoint
    from models.model import ModelConfig, Transformer

    if args.checkpoint:
        return load_checkpoint(args.checkpoint)
    torch.manual_seed(args.seed)
    log.warning("no --checkpoint: generating from a randomly initialised %r model", args.preset)
    return Transformer(ModelConfig.from_preset(args.preset))


def _resolve_tokenizer_spec(args: argparse.Namespace) -> str:
    """--tokenizer wins; else the tokenizer saved in the checkpoint folder; else the bundled default."""
    if args.tokenizer:
        return args.tokenizer
    if args.checkpoint:
        for candidate in (Path(args.checkpoint) / "tokenizer.model", Path(args.checkpoint) / "original" / "tokenizer.model"):
            if candidate.is_file():
                return str(candidate)
    return "default"


def _generate(args: argparse.Namespace) -> None:
    import torch

    from data.tokenizer import Tokenizer
    from models.generation import generate
    from trainer.checks import check_tokenizer_fits_model

    tokenizer = Tokenizer.load(_resolve_tokenizer_spec(args))
    model = _load_model_for_generation(args)
    check_tokenizer_fits_model(tokenizer, model.config, model_name=args.checkpoint or f"preset {args.preset}")
    if args.chat:
        prompt = tokenizer.encode_chat_prompt([{"role": "user", "content": args.prompt}])
    else:
        prompt = tokenizer.encode(args.prompt, bos=True)
    generator = torch.Generator().manual_seed(args.seed)
    out = generate(
        model,
        [prompt],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        generator=generator,
    )
    new_tokens = out.tokens[0][out.mask[0]].tolist()
    if new_tokens and new_tokens[-1] in tokenizer.stop_ids:
        new_tokens = new_tokens[:-1]
    print(args.prompt + tokenizer.decode(new_tokens))


def _convert(args: argparse.Namespace) -> None:
    from models.checkpoint import convert

    out = convert(src=args.src, src_format=args.src_format, dst=args.dst, dst_format=args.dst_format)
    print(f"wrote {args.dst_format} checkpoint to {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lantern", description="Train Llama-style language models end to end.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tokenizer = commands.add_parser("tokenizer", help="train byte-level BPE tokenizers")
    tokenizer_commands = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    train = tokenizer_commands.add_parser("train", help="train a BPE tokenizer and write a tiktoken file")
    train.add_argument("--corpus", nargs="+", required=True, help="text file(s) to train on")
    train.add_argument("--vocab-size", type=int, required=True, help="total vocabulary, incl. 256 special tokens")
    train.add_argument("--out", required=True, help="output .tiktoken file")
    train.set_defaults(handler=_tokenizer_train)

    gen = commands.add_parser("generate", help="generate text from a checkpoint (KV cache)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="native, Hugging Face or Meta checkpoint folder")
    source.add_argument("--preset", help="random weights of a model preset (a smoke test)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--tokenizer", help="tokenizer file, 'default' or 'cl100k_base' (default: the checkpoint's)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(handler=_generate)

    convert = commands.add_parser("convert", help="convert checkpoints between formats")
    convert.add_argument("--from", dest="src_format", choices=["auto", "hf", "meta", "native"], default="auto")
    convert.add_argument("src", help="source checkpoint folder")
    convert.add_argument("--to", dest="dst_format", choices=["hf", "native"], required=True)
    convert.add_argument("dst", help="destination folder")
    convert.set_defaults(handler=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        # Input errors are the user's to fix: one clear line, not a traceback.
        print(f"lantern {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
