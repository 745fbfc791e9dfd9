"""Tokenizers between GGUF files and Hugging Face tokenizer files: writing ``tokenizer.json`` + ``tokenizer_config.json``
as transformers 4.45+ and 5 both load them (``write_tokenizer_files``), a GGUF's tokenizer as those files
(``write_gguf_tokenizer_files``), and a BPE ``tokenizer.json`` as llama.cpp's ``tokenizer.ggml.*`` fields
(``gguf_tokenizer_fields``).

Two kinds of BPE are written: byte-level (``gpt2``, with a pre-tokenizer llama.cpp names: ``_PRE_NAMES``) and
sentencepiece-spelled with byte fallback (``llama``: Gemma's, Llama 2's; merge order as scores). Anything else is
refused in one line rather than written with splits llama.cpp would not reproduce. gguf and transformers are
imported inside the functions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.errors import LanternError
from models.formats.gguf_reader import parsed_once
from models.formats.tokenizer_files import read_json_if_present, special_token_string

__all__ = ["LLAMA3_SPLIT", "gguf_tokenizer_fields", "write_gguf_tokenizer_files", "write_tokenizer_files"]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"

# Meta's Llama 3 pre-tokenizer regex (the tiktoken backend's LLAMA3_PAT; the tests check they are equal) and
# OpenAI's cl100k_base one, which llama.cpp splits as Llama 3's ("dbrx"). Oniguruma (tokenizers) reads the
# possessive ``{1,3}+`` as a nested repetition, so cl100k's is also written without it.
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CL100K_SPLIT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
_PRE_NAMES = {
    ("split", LLAMA3_SPLIT): "llama-bpe",
    ("split", _CL100K_SPLIT): "dbrx",
    ("split", _CL100K_SPLIT.replace("{1,3}+", "{1,3}")): "dbrx",
    ("bytelevel",): "gpt-2",
    ("digits", "bytelevel"): "smollm",
}
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 3, 4, 5, 6  # gguf.TokenType values
_SPACE = "\u2581"  # sentencepiece's spelling of a space
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")  # byte fallback's tokens
_SPECIAL_SCORE = -1000.0  # what llama.cpp's converters give control and added tokens (never merged)


def write_tokenizer_files(
    folder: Path,
    tokenizer: Any,
    *,
    bos_token: str | None,
    eos_token: str | None,
    pad_token: str | None = None,
    unk_token: str | None = None,
    chat_template: str | None = None,
    add_bos_token: bool = False,
    eos_token_ids: list[int] | None = None,
) -> list[Path]:
    """``tokenizer`` (a ``tokenizers.Tokenizer``) as tokenizer.json, tokenizer_config.json (special tokens, chat
    template) and generation_config.json (bos id, ``eos_token_ids`` or the eos token's id) in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / TOKENIZER_JSON))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # loads in transformers 4.x and 5 alike
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "unk_token": unk_token,
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    written = [folder / TOKENIZER_JSON, folder / TOKENIZER_CONFIG]
    bos_id = tokenizer.token_to_id(bos_token) if bos_token is not None else None
    eos_ids = eos_token_ids or ([tokenizer.token_to_id(eos_token)] if eos_token is not None else [])
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    generation = {k: v for k, v in generation.items() if v not in (None, [])}
    if generation:
        (folder / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        written.append(folder / GENERATION_CONFIG)
    return written


@parsed_once
def write_gguf_tokenizer_files(gguf_file: str | Path, folder: str | Path) -> list[Path]:
    """The tokenizer of a GGUF file as Hugging Face files in ``folder`` (created if missing), rebuilt by transformers'
    GGUF tokenizer loader; bos/eos ids as the GGUF states them go to generation_config.json."""
    from transformers import AutoTokenizer

    path = Path(gguf_file)
    if not path.is_file():
        raise LanternError(f"GGUF file not found: {path}")
    loaded = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    backend = _spaces_as_llama_cpp(_only_the_files_tokens(loaded, path))
    eos_ids = [backend.token_to_id(loaded.eos_token)] if loaded.eos_token is not None else None
    template = loaded.chat_template if isinstance(loaded.chat_template, str) else None
    return write_tokenizer_files(
        Path(folder),
        backend,
        bos_token=loaded.bos_token,
        eos_token=loaded.eos_token,
        pad_token=loaded.pad_token,
        unk_token=loaded.unk_token,
        chat_template=template,
        add_bos_token=bool(getattr(loaded, "add_bos_token", False)),
        eos_token_ids=eos_ids,
    )


def _only_the_files_tokens(loaded: Any, path: Path) -> Any:
    """The backend tokenizer of ``loaded`` without the tokens transformers' GGUF reader adds past the file's
    vocabulary (GPT-2's "<|endoftext|>" to a ``gpt2`` tokenizer that lacks it): a model folder written from the file
    would otherwise hold a tokenizer one token larger than its embeddings. A special token that was one is unset."""
    from models.formats.gguf_format import gguf_fields  # deferred: that module imports this one

    count = gguf_fields(path)["tokenizer.ggml.tokens"]  # its length: gguf_fields gives an array's
    backend = loaded.backend_tokenizer
    if backend.get_vocab_size(with_added_tokens=True) <= count:
        return backend
    spec = json.loads(backend.to_str())
    extra = {token["content"] for token in spec.get("added_tokens", []) if token["id"] >= count}
    spec["added_tokens"] = [token for token in spec.get("added_tokens", []) if token["id"] < count]
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(loaded, name, None) in extra:
            setattr(loaded, name, None)
    return type(backend).from_str(json.dumps(spec))


def _spaces_as_llama_cpp(backend: Any) -> Any:
    """A sentencepiece tokenizer read with transformers' ``Metaspace``, which skips the prefix "\u2581" on text that
    starts with a space, spelled instead as llama.cpp tokenizes GGUF files: every space "\u2581", and the prefix
    always (``add_space_prefix``), as a normalizer (the same as ``_adds_space_prefix`` reads back)."""
    from tokenizers import normalizers, pre_tokenizers

    pre = backend.pre_tokenizer  # read as an object: serialising the tokenizer would copy its whole vocabulary
    if backend.normalizer is not None or not isinstance(pre, pre_tokenizers.Metaspace) or pre.split:
        return backend
    spaces = normalizers.Replace(" ", _SPACE)
    prefix = pre.prepend_scheme != "never"
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), spaces]) if prefix else spaces
    backend.pre_tokenizer = None
    return backend


def _pre_name(pre: Any, where: Path) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for a tokenizer.json pre-tokenizer, or a one-line refusal."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, Mapping) and pre.get("type") == "Sequence" else [pre]
    shape: list[str] = []
    for step in steps:
        kind = step.get("type") if isinstance(step, Mapping) else None
        if kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
            shape += ["split", step.get("pattern", {}).get("Regex", "")]
        elif kind == "ByteLevel" and not step.get("add_prefix_space"):
            if step.get("use_regex", True):  # GPT-2's regex; without it, the byte spelling only (after a Split)
                shape.append("bytelevel")
        elif kind == "Digits" and step.get("individual_digits"):
            shape.append("digits")
        else:
            shape.append(json.dumps(step, sort_keys=True))
    name = _PRE_NAMES.get(tuple(shape))
    if name is None:
        raise LanternError(
            f"{where}: its pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp name "
            f"(GGUF export knows Llama 3's and cl100k's regex splits, GPT-2's and SmolLM's)"
        )
    return name


def _bpe_kind(data: Mapping[str, Any], where: Path) -> tuple[str, bool | None]:
    """(``byte-level``: GPT-2's byte alphabet, Llama 3, Qwen, SmolLM; or ``sentencepiece``: a BPE over
    "\u2581"-spelled text with byte fallback, Gemma, Llama 2, Mistral v0.1; and then whether it adds the prefix
    "\u2581", else None), or a one-line refusal of anything GGUF cannot express."""
    model, decoder = data.get("model") or {}, data.get("decoder") or {}
    if model.get("type") == "BPE" and "ByteLevel" in json.dumps([data.get("pre_tokenizer"), decoder]):
        if data.get("normalizer") is not None:
            raise LanternError(f"{where}: a normalizer ({data['normalizer'].get('type')}) has no GGUF equivalent")
        return "byte-level", None
    if model.get("type") == "BPE" and model.get("byte_fallback") and _SPACE in json.dumps(decoder, ensure_ascii=False):
        if (space_prefix := _adds_space_prefix(data)) is not None:
            return "sentencepiece", space_prefix
        raise LanternError(
            f"{where}: its normalizer {json.dumps(data.get('normalizer'))[:160]} and pre-tokenizer "
            f"{json.dumps(data.get('pre_tokenizer'))[:160]} are not a sentencepiece spelling llama.cpp reproduces"
        )
    raise LanternError(
        f"{where}: GGUF export handles byte-level and sentencepiece BPE tokenizers, this one is {model.get('type')}"
        + ("" if model.get("type") != "BPE" else " without either's spelling")
    )


def _adds_space_prefix(data: Mapping[str, Any]) -> bool | None:
    """Whether a sentencepiece-spelled tokenizer.json puts "\u2581" before the text (llama.cpp's
    ``add_space_prefix``); None when its spaces are not simply spelled "\u2581" (then it is not written)."""
    normalizer, pre = data.get("normalizer"), data.get("pre_tokenizer")
    steps = normalizer.get("normalizers", []) if isinstance(normalizer, Mapping) and normalizer.get(
        "type") == "Sequence" else [normalizer]  # fmt: skip
    shape = [json.dumps(step, sort_keys=True) for step in steps if step is not None]
    spaces = json.dumps({"content": _SPACE, "pattern": {"String": " "}, "type": "Replace"}, sort_keys=True)
    prefix = json.dumps({"prepend": _SPACE, "type": "Prepend"}, sort_keys=True)
    # after spaces became "\u2581", a Split on " " (Gemma's) finds none: it changes nothing
    inert = pre is None or (pre.get("type") == "Split" and pre.get("pattern") == {"String": " "})
    if shape == [spaces] and inert:
        return False
    if shape == [prefix, spaces] and inert:
        return True
    metaspace = isinstance(pre, Mapping) and pre.get("type") == "Metaspace" and pre.get("replacement") == _SPACE
    if not shape and metaspace and not pre.get("split", True):
        return pre.get("prepend_scheme", "always") != "never"
    return None


def _merge_scores(tokens: list[str], types: list[int], merges: list[str]) -> list[float]:
    """llama.cpp's sentencepiece scores: it merges the adjacent pair whose joined token scores highest, so a token
    scores minus the rank of the first merge making it, which replays the tokenizer.json's merge order. Tokens no
    merge makes score below every merged one (a single character is never a merge's result)."""
    rank: dict[str, int] = {}
    for index, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", "", 1), index)
    unmerged = {_NORMAL: -float(len(merges) + 1), _BYTE: 0.0}  # by token type; the rest: _SPECIAL_SCORE
    return [
        -float(rank[token]) if token in rank else unmerged.get(kind, _SPECIAL_SCORE)
        for token, kind in zip(tokens, types)
    ]


def gguf_tokenizer_fields(folder: str | Path, vocab_size: int | None = None) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields (and ``tokenizer.chat_template``) for the BPE ``tokenizer.json`` in
    ``folder``, with its tokenizer_config.json (special tokens, add_bos_token, chat template) or chat_template.jinja.
    ``vocab_size`` (the model's) pads the token list with UNUSED ``[PAD<id>]`` tokens; fewer is refused."""
    folder = Path(folder)
    where = folder / TOKENIZER_JSON
    if not where.is_file():
        if (folder / "tokenizer.model").is_file() or (folder / "original" / "tokenizer.model").is_file():
            raise LanternError(
                f"{folder} holds a tiktoken tokenizer.model, not tokenizer.json: `lantern convert --to gguf` and "
                "`lantern export --format gguf` convert it first; in code, use write_hf_tokenizer from data/tokenizer"
            )
        raise LanternError(f"no {TOKENIZER_JSON} in {folder}: GGUF export needs the tokenizer as Hugging Face files")
    data = read_json_if_present(where)
    model = data.get("model") or {}
    kind, space_prefix = _bpe_kind(data, where)
    entries = {int(i): (token, _NORMAL) for token, i in model["vocab"].items()}
    if kind == "sentencepiece":  # byte fallback's <0xXX> tokens are llama.cpp's BYTE tokens
        entries.update({i: (t, _BYTE) for i, (t, _) in entries.items() if _BYTE_TOKEN.fullmatch(t)})
    for added in data.get("added_tokens", []):
        entries[int(added["id"])] = (added["content"], _CONTROL if added.get("special") else _USER_DEFINED)
    size = max(entries) + 1
    if vocab_size is not None and size > vocab_size:
        raise LanternError(f"{where}: {size} tokens do not fit the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(max(size, vocab_size or 0)):
        token, token_type = entries.get(i, (f"[PAD{i}]", _UNUSED))
        tokens.append(token)
        types.append(token_type)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    # the merges too with sentencepiece: llama.cpp merges by the scores, transformers' reader (and so `lantern convert
    # --from gguf`) takes the merges a file lists, rather than rebuilding them from the vocabulary in another order
    fields: dict[str, Any] = {"tokens": tokens, "token_type": types, "merges": merges}
    if kind == "byte-level":
        fields |= {"model": "gpt2", "pre": _pre_name(data.get("pre_tokenizer"), where)}
    else:
        fields |= {"model": "llama", "pre": "default", "scores": _merge_scores(tokens, types, merges),
                   "add_space_prefix": space_prefix}  # fmt: skip

    config = read_json_if_present(folder / TOKENIZER_CONFIG)
    ids = {token: i for i, token in enumerate(tokens)}
    for name, key in (("bos", "bos_token"), ("eos", "eos_token"), ("pad", "pad_token"), ("unk", "unk_token")):
        token = special_token_string(config.get(key))
        if token is not None and token not in ids:
            raise LanternError(f"{folder / TOKENIZER_CONFIG}: {key} {token!r} is not in {TOKENIZER_JSON}")
        fields[f"{name}_id"] = ids.get(token) if token is not None else None
    if fields["eos_id"] is None:  # generation_config.json's first eos id, as transformers would stop on
        eos = read_json_if_present(folder / GENERATION_CONFIG).get("eos_token_id")
        fields["eos_id"] = eos[0] if isinstance(eos, list) and eos else eos
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # a post-processor that writes the bos token adds it (Llama 3's tokenizer.json)
        bos = tokens[fields["bos_id"]] if fields["bos_id"] is not None else None
        add_bos = bos is not None and f'"id": "{bos}"' in json.dumps(data.get("post_processor"))
    fields["add_bos_token"] = bool(add_bos)
    fields["add_eos_token"] = bool(config.get("add_eos_token", False))
    template = config.get("chat_template")
    if (folder / CHAT_TEMPLATE_FILE).is_file():  # transformers reads it over tokenizer_config.json's
        template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    fields["chat_template"] = template
    return fields


def add_tokenizer_fields(writer: Any, fields: Mapping[str, Any]) -> None:
    """Write ``gguf_tokenizer_fields``'s result with a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_type"])
    writer.add_token_merges(fields["merges"])
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
        writer.add_add_space_prefix(fields["add_space_prefix"])
    for name, add in (
        ("bos_id", writer.add_bos_token_id),
        ("eos_id", writer.add_eos_token_id),
        ("pad_id", writer.add_pad_token_id),
        ("unk_id", writer.add_unk_token_id),
    ):
        if fields.get(name) is not None:
            add(int(fields[name]))
    writer.add_add_bos_token(fields["add_bos_token"])
    writer.add_add_eos_token(fields["add_eos_token"])
    if fields.get("chat_template"):
        writer.add_chat_template(fields["chat_template"])
