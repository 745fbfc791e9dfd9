"""
Tiktoken tokenizers as Hugging Face files: a Lantern rank file (or cl100k_base) with its 256 Llama 3 special tokens
as ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``generation_config.json``), so transformers' ``AutoTokenizer``
(and, through ``models.formats.gguf_format.write_gguf``, a GGUF file) encodes the ids Lantern's ``Tokenizer`` does.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from data.tokenizer.base import load_tokenizer
from data.tokenizer.files import is_rank_file, read_rank_file, tokenizer_file
from data.tokenizer.tokenizer import LLAMA3_PAT, Tokenizer
from models.errors import LanternError
from models.formats.gguf_tokenizer import (
    GENERATION_CONFIG,
    write_tokenizer_files,
)

__all__ = [
    "LLAMA3_CHAT_TEMPLATE",
    "hf_export_files",
    "hf_tokenizer_folder",
    "tiktoken_to_tokenizer_json",
    "with_hf_tokenizer_files",
    "write_hf_tokenizer",
]

# Llama 3's template in the layout of Tokenizer.encode_chat / encode_chat_prompt: BOS once, then per message its
# header, "\n\n", the content stripped and <|eot_id|>; the generation prompt is an open assistant header.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"
STOP_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")  # Tokenizer.stop_ids


def _oniguruma_pattern(pat_str: str) -> str:
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pat_str)


def tiktoken_to_tokenizer_json(
    ranks: Mapping[bytes, int] | str | Path,
    special_tokens: Mapping[str, int],
    pat_str: str = LLAMA3_PAT,
    bos_token: str | None = BOS,
) -> Any:
    """A ``tokenizers.Tokenizer`` encoding as tiktoken does with these ranks (a mapping or a rank file), regex and
    special tokens (ids N.. after the N ranks, in id order). ``bos_token`` (None: none) is prepended by its
    post-processor, as ``Tokenizer.encode(text, bos=True)``; ``add_special_tokens=False`` gives ``encode(text)``."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if not isinstance(ranks, Mapping):
        ranks = read_rank_file(ranks)[0]
    specials = sorted(special_tokens.items(), key=lambda item: item[1])
    if [i for _, i in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise LanternError(f"special token ids must follow the {len(ranks)} ranks without gaps, got {specials[:3]}...")
    spelling = bytes_to_unicode()  # GPT-2's printable character for each byte

    def spell(token: bytes) -> str:
        return "".join(spelling[b] for b in token)

    # TikTokenConverter's merges: every split of a token into two tokens, by the token's rank, then the pieces'
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[left], ranks[right], left, right) for left, right in splits]
    merges.sort(key=lambda merge: merge[:3])
    bpe = models.BPE(
        {spell(token): rank for token, rank in ranks.items()},
        [(spell(left), spell(right)) for *_, left, right in merges],
        fuse_unk=False,
        ignore_merges=True,  # a piece that is a token is that token, as tiktoken does
    )
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_oniguruma_pattern(pat_str)), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, _ in specials])
    steps = [processors.ByteLevel(trim_offsets=False)]
    if bos_token is not None:
        bos_id = special_tokens[bos_token]
        pair = f"{bos_token}:0 $A:0 {bos_token}:1 $B:1"
        steps.append(processors.TemplateProcessing(f"{bos_token}:0 $A:0", pair, [(bos_token, bos_id)]))
    tokenizer.post_processor = processors.Sequence(steps)
    wrong = [(t, i, tokenizer.token_to_id(t)) for t, i in specials if tokenizer.token_to_id(t) != i]
    if wrong:
        raise LanternError(f"special tokens got other ids than asked (token, asked, got): {wrong[:3]}")
    return tokenizer


def write_hf_tokenizer(tokenizer: Tokenizer | str | Path, folder: str | Path) -> list[Path]:
    """A Lantern tiktoken tokenizer (a ``Tokenizer``, a rank file, "default" or "cl100k_base") as tokenizer.json,
    tokenizer_config.json (bos <|begin_of_text|>, eos <|end_of_text|>, pad <|finetune_right_pad_id|>, add_bos_token,
    ``LLAMA3_CHAT_TEMPLATE``) and generation_config.json (bos id, the three stop ids) in ``folder``."""
    if not isinstance(tokenizer, Tokenizer):
        spec = str(tokenizer)
        tokenizer = Tokenizer.cl100k_base() if spec == "cl100k_base" else Tokenizer.from_file(tokenizer_file(spec))
    specials = tokenizer.special_tokens
    # the ranks and regex the tiktoken encoding was built from (already read and checked when it was loaded)
    encoding = tokenizer.encoding
    converted = tiktoken_to_tokenizer_json(encoding._mergeable_ranks, specials, encoding._pat_str, BOS)
    return write_tokenizer_files(
        Path(folder),
        converted,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=LLAMA3_CHAT_TEMPLATE,
        add_bos_token=True,
        eos_token_ids=[specials[token] for token in STOP_TOKENS],
    )


def with_hf_tokenizer_files(files: Mapping[str, Path], scratch: str | Path) -> dict[str, Path]:
    """A tokenizer's ``files`` with, beside a tiktoken rank file, its tokenizer.json and tokenizer_config.json
    (converted in ``scratch``), so that a model folder written with them is one transformers' ``AutoTokenizer``
    loads; the rank file stays, and Lantern's reader takes it first. Other files are returned as they are."""
    if "tokenizer.model" not in files or "tokenizer.json" in files or not is_rank_file(Path(files["tokenizer.model"])):
        return dict(files)  # (a sentencepiece tokenizer.model: no conversion of ours)
    return {**hf_export_files(files["tokenizer.model"], scratch), **files}


def hf_tokenizer_folder(checkpoint: str | Path, scratch: str | Path) -> Path:
    """A folder of the Hugging Face files of the tokenizer a checkpoint folder carries (the one every command would
    read, ``load_tokenizer``): the folder holding its tokenizer.json when the file has that name (so that errors
    about it name the user's own file), else ``scratch`` with the files copied (a tokenizer.json saved under the
    rank file's name) or converted (``write_hf_tokenizer``: a tiktoken rank file). Raises LanternError when the
    folder carries none."""
    scratch = Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = load_tokenizer(checkpoint)
    except FileNotFoundError as error:
        raise LanternError(str(error)) from None
    if isinstance(tokenizer, Tokenizer):
        write_hf_tokenizer(tokenizer, scratch)
        return scratch
    files = tokenizer.files  # generation_config.json among them, when the folder has one
    if files["tokenizer.json"].name == "tokenizer.json":  # its companions are read from the same folder
        return files["tokenizer.json"].parent
    for name, path in files.items():
        shutil.copyfile(path, scratch / name)
    return scratch


def hf_export_files(spec: str | Path, scratch: str | Path) -> dict[str, Path]:
    """The tokenizer files a Hugging Face export carries, so transformers' ``AutoTokenizer`` loads it as it is: a
    tokenizer.json tokenizer's own files, or a tiktoken rank file (kept for ``original/tokenizer.model``) with its
    conversion (``write_hf_tokenizer``, written in ``scratch``). None for a folder that carries no tokenizer."""
    try:
        tokenizer = load_tokenizer(spec)
    except FileNotFoundError:
        return {}
    if not isinstance(tokenizer, Tokenizer):
        return tokenizer.files
    written = write_hf_tokenizer(tokenizer, scratch)
    return {**{path.name: path for path in written if path.name != GENERATION_CONFIG}, **tokenizer.files}
