"""
Hugging Face tokenizers: a checkpoint's ``tokenizer.json`` read by the ``tokenizers`` library, with the special
tokens and chat template of its ``tokenizer_config.json`` (or ``chat_template.jinja``) and the stop ids of its
``generation_config.json``.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from data.tokenizer.base import TokenizerBase, _as_ints, check_message
from data.tokenizer.chat_template import ChatTemplate
from models.formats.tokenizer_files import HF_TOKENIZER_FILES, read_json_if_present, special_token_string

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class HFTokenizer(TokenizerBase):
    """A Hugging Face ``tokenizer.json`` and its companion files, read from the folder that holds it."""

    def __init__(self, tokenizer_json: str | Path):
        path = Path(tokenizer_json)
        folder = path.parent
        try:
            raw = path.read_bytes()
            self._tk = RustTokenizer.from_str(raw.decode("utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"tokenizer file not found: {path}") from None
        except Exception as error:  # the Rust library's own parse errors
            raise ValueError(f"{path}: not a Hugging Face tokenizer.json ({str(error).splitlines()[0]})") from None
        self.path = str(path)
        self._json_path = path
        companions = {name: folder / name for name in HF_TOKENIZER_FILES if (folder / name).is_file()}
        self._files = {**companions, "tokenizer.json": path}
        config = {
            **read_json_if_present(folder / "special_tokens_map.json"),
            **read_json_if_present(folder / "tokenizer_config.json"),
        }
        added = self._tk.get_added_tokens_decoder()
        self._added = {t.content: i for i, t in added.items()}
        self._special = {i for i, t in added.items() if t.special}
        self.special_strings = {name: special_token_string(config.get(name)) for name in _SPECIAL_NAMES}
        ids = {
            name: self._id_of(token, folder / "tokenizer_config.json") for name, token in self.special_strings.items()
        }
        generation = read_json_if_present(folder / "generation_config.json")
        eos_ids = generation.get("eos_token_id")
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        eos = ids["eos_token"] if ids["eos_token"] is not None else (eos_ids[0] if eos_ids else None)
        if eos is None:
            raise ValueError(
                f"{folder}: no eos_token in tokenizer_config.json nor eos_token_id in generation_config.json"
            )
        self.eos_id: int = eos
        self.bos_id: int | None = ids["bos_token"] if ids["bos_token"] is not None else generation.get("bos_token_id")
        self.pad_id: int = ids["pad_token"] if ids["pad_token"] is not None else self.eos_id
        self.template = self._chat_template(folder, config)
        self.eot_id: int = self._end_of_turn()
        self.stop_ids: set[int] = {self.eos_id, self.eot_id, *eos_ids}
        digest = hashlib.sha256(b"lantern-hf-tokenizer-v1\n" + raw)
        digest.update(json.dumps([self.special_strings, self.template.source if self.template else None]).encode())
        self.fingerprint = digest.hexdigest()
        self._decoder_kind = type(self._tk.decoder).__name__  # "ByteLevel": GPT-2's byte alphabet

    def _id_of(self, token: str | None, source: Path) -> int | None:
        if token is None:
            return None
        id = self._tk.token_to_id(token)
        if id is None:
            raise ValueError(f"{source}: special token {token!r} is not in {self._json_path.name}'s vocabulary")
        return id

    def _chat_template(self, folder: Path, config: Mapping[str, Any]) -> ChatTemplate | None:
        source, where = None, folder / "chat_template.jinja"
        if where.is_file():
            source = where.read_text(encoding="utf-8")
        else:
            source, where = config.get("chat_template"), folder / "tokenizer_config.json"
            if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
                source = named.get("default")
        if not source:
            return None
        template = ChatTemplate(source, self.special_strings, where=str(where))
        for name, token in self.special_strings.items():
            if token is None and name in source:
                raise ValueError(f"{where}: the chat template uses {name}, which this tokenizer does not define")
        return template

    def _end_of_turn(self) -> int:
        """The special token the template writes right after an assistant turn's content (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>); the eos token for a template that writes none, or for no template."""
        if self.template is None:
            return self.eos_id
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]
        text, spans = self.template.render_with_spans(probe, end_of_turn=self._tk.id_to_token(self.eos_id))
        if not spans:
            return self.eos_id
        start, end = spans[-1]
        body = text[start:end]
        after = body.find("Yes") + len("Yes") if "Yes" in body else 0
        for id in self._tk.encode(body[after:], add_special_tokens=False).ids:
            if id in self._special or id == self.eos_id:
                return id
        return self.eos_id

    # --- the contract ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return max(self._tk.get_vocab_size(with_added_tokens=True), max(self._added.values(), default=-1) + 1)

    @property
    def files(self) -> dict[str, Path]:
        return dict(self._files)

    def token_to_id(self, token: str) -> int:
        id = self._tk.token_to_id(token)
        if id is None:
            raise ValueError(f"unknown token {token!r}")
        return id

    def id_to_piece(self, id: int) -> str:
        self._check_ids([id])
        return self._tk.id_to_token(id)

    def is_special(self, id: int) -> bool:
        return id in self._special

    def token_bytes(self, id: int) -> bytes:
        piece = self._tk.id_to_token(id)
        if piece is None:
            return b""
        if id in self._added:
            return piece.encode("utf-8")
        if self._decoder_kind == "ByteLevel":
            table = _byte_decoder()
            return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode("utf-8")

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Encode plain text; special-token strings in it are plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self._with_ends(self._plain([text])[0], bos, eos)

    def encode_as_hf(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False, num_threads: int = 8
    ) -> list[list[int]]:
        """encode() for many texts (the library's own batch encoder; its thread pool ignores ``num_threads``)."""
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"encode_batch expects str items, got {type(text).__name__}")
        encoded = self._plain(list(texts))
        if not eos and (not bos or self.bos_id is None):
            return encoded  # nothing to add: no copy of every list (lantern prepare places BOS / EOS itself)
        return [self._with_ends(ids, bos, eos) for ids in encoded]

    def start_encode_batch(self, texts: Sequence[str]) -> Callable[[], list[list[int]]]:
        """The library's batch encoder now (its own thread pool, the GIL released); the encodings' ids become
        Python lists, under the GIL, only when the returned function is called."""
        encodings = self._plain_tokenizer().encode_batch_fast(list(texts), add_special_tokens=False)
        return lambda: [e.ids for e in encodings]

    def _plain(self, texts: list[str]) -> list[list[int]]:
        return self.start_encode_batch(texts)()

    def _plain_tokenizer(self) -> RustTokenizer:
        """A second copy of the library's tokenizer that reads special-token strings as text. A copy, not a flag
        toggled around each call: with calls on several threads (lantern prepare encodes on a thread of its own) one
        thread's toggle reaches another's call, and "<|im_end|>" in a document became the special token."""
        plain = self.__dict__.get("_plain_tk")
        if plain is None:  # made on first use (parsing tokenizer.json again); a race only makes it twice
            plain = RustTokenizer.from_str(self._tk.to_str())
            plain.encode_special_tokens = True
            self._plain_tk = plain
        return plain

    def _with_ends(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text; special tokens come out as their strings."""
        ids = _as_ints(ids)
        self._check_ids(ids)
        return self._tk.decode(ids, skip_special_tokens=False)

    # --- chat ----------------------------------------------------------------------

    @property
    def renders_tools(self) -> bool:
        return self.template is not None and self.template.renders_tools

    def _require_template(self) -> ChatTemplate:
        if self.template is None:
            raise ValueError(
                f"{Path(self.path).parent} has no chat template (chat_template in tokenizer_config.json or chat_template.jinja): "
                "a base model's tokenizer cannot encode chats"
            )
        return self.template

    def _check_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        for index, message in enumerate(messages):
            check_message(index, message, roles=None)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[list[int], list[bool]]:
        """Ids as ``apply_chat_template(messages, tools=tools)`` gives them; mask True on each assistant turn's content
        and its end-of-turn token (tool and user turns are context)."""
        self._check_messages(messages)
        messages, tools = self.offer_tools(messages, tools)
        end_of_turn = self._tk.id_to_token(self.eot_id)
        text, spans = self._require_template().render_with_spans(messages, end_of_turn, tools)
        encoding = self._tk.encode(text, add_special_tokens=False)
        ids = encoding.ids
        starts = [start for start, _ in encoding.offsets]
        mask = [False] * len(ids)
        for span_start, span_end in spans:
            first = bisect.bisect_left(starts, span_start)
            last = bisect.bisect_left(starts, span_end)
            turn = range(first, last)
            # stop at the turn's (last) end-of-turn token: what the template writes after it is not the model's
            stop = max((i for i in turn if ids[i] == self.eot_id), default=last - 1)
            for i in range(first, stop + 1):
                mask[i] = True
        return ids, mask

    def encode_chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Ids as ``apply_chat_template(messages, add_generation_prompt=True, tools=tools)`` gives them."""
        self._check_messages(messages)
        messages, tools = self.offer_tools(messages, tools)
        text = self._require_template().render(messages, add_generation_prompt=True, tools=tools)
        return self._tk.encode(text, add_special_tokens=False).ids
