"""
What every Lantern tokenizer is, whichever library encodes: the tiktoken rank files and
Hugging Face ``tokenizer.json``; and ``check_utf8``: whether a text file is UTF-8, naming the line and byte offset
of the first bad byte.
"""

from __future__ import annotations

import codecs
import gzip
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from models.errors import DataError

CHAT_ROLES = ("system", "user", "assistant", "ipython", "tool")

# how a conversation offers tools to a model whose chat template does not write them (SmolLM2-135M's, the built-in
# Llama 3 format): in the system turn, in the words and <tool_call> JSON format of Qwen2.5's and Hermes' templates
TOOL_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def with_tool_instructions(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` with ``tools`` (OpenAI's function format) described in the system turn, added when there is none."""
    import json

    text = TOOL_INSTRUCTIONS.format(tools="\n".join(json.dumps(tool) for tool in tools))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *map(dict, messages[1:])]
    return [{"role": "system", "content": text}, *map(dict, messages)]


class TokenizerBase:
    """Common contract. Subclasses set ``path``, ``fingerprint``, ``bos_id`` (or None), ``eos_id``, ``pad_id``,
    ``eot_id`` (the token that ends an assistant turn), ``stop_ids`` and implement the methods below that raise."""

    path: str
    fingerprint: str
    bos_id: int | None
    eos_id: int
    pad_id: int
    eot_id: int
    stop_ids: set[int]

    # --- what a backend provides ------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can produce."""
        raise NotImplementedError

    @property
    def files(self) -> dict[str, Path]:
        """The files a checkpoint folder carries for this tokenizer, by the name they take there."""
        raise NotImplementedError

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        raise NotImplementedError

    def encode_as_hf(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Encode ``text`` as Hugging Face's tokenizer does: special-token strings in it are those tokens, and
        ``add_special_tokens`` adds what the tokenizer's own template adds (a BOS for Llama 3, nothing for SmolLM2).
        For evaluation harnesses, whose prompts may be rendered chat templates; training data uses ``encode``."""
        raise NotImplementedError

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False, num_threads: int = 8
    ) -> list[list[int]]:
        raise NotImplementedError

    def start_encode_batch(self, texts: Sequence[str]) -> Callable[[], list[list[int]]]:
        """``encode`` of many texts (no BOS/EOS) in two steps: the encoding now, on one thread of the caller's
        (or the backend's own pool), and the id lists when the returned function is called, which may be on
        another thread: a pipeline then encodes the next batch while the last one's ids become lists."""
        ids = self.encode_batch(texts, num_threads=1)
        return lambda: ids

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, id: int) -> bytes:
        """The bytes one id stands for (a special token: its name)."""
        raise NotImplementedError

    def is_special(self, id: int) -> bool:
        raise NotImplementedError

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[list[int], list[bool]]:
        """(ids, mask): mask is True exactly on each assistant turn's content and its end-of-turn token; ``tools``:
        the functions the model may call (OpenAI's format), as the chat template renders them."""
        raise NotImplementedError

    def encode_chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The conversation followed by what opens an assistant turn: the prompt to generate a reply from."""
        raise NotImplementedError

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template writes the tools it is given; when it does not, ``encode_chat(..., tools=...)``
        describes them in the system turn (``with_tool_instructions``)."""
        return False

    def offer_tools(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[Sequence[Mapping[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools for the template): the tools as the template writes them, else in the system turn."""
        if not tools:
            return messages, None
        if self.renders_tools:
            return messages, list(tools)
        return with_tool_instructions(messages, tools), None

    # --- shared ------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of ids, which may end inside a multi-byte character (token healing cuts in bytes)."""
        ids = _as_ints(ids)
        self._check_ids(ids)
        return b"".join(self.token_bytes(i) for i in ids)

    def tokens_starting_with(self, prefix: bytes) -> list[int]:
        """Ids of the ordinary (non-special) tokens whose bytes start with ``prefix`` (token healing)."""
        if not hasattr(self, "_ordinary_bytes"):  # built once: one bytes object per id
            self._ordinary_bytes = [(i, self.token_bytes(i)) for i in range(self.vocab_size) if not self.is_special(i)]
        return [i for i, piece in self._ordinary_bytes if piece.startswith(prefix)]

    def heal_prompt(self, ids: Sequence[int]) -> tuple[list[int], bytes, list[int]]:
        """Token healing: back off the prompt's last token when it is an ordinary token that longer tokens
        extend (e.g. ':' of "ROMEO:", which the corpus only ever shows merged as ':\\n').

        Returns (prompt without it, its bytes, the ids whose bytes start with them). Generation then draws its
        first token from those ids, so the text can continue the way training data did. Nothing is backed off
        (removed is b"") when the prompt would become empty, the last token is special, or no longer token
        extends it (healing could then only re-pick the same token).
        """
        ids = _as_ints(ids)
        self._check_ids(ids)
        if len(ids) < 2 or self.is_special(ids[-1]):
            return ids, b"", []
        removed = self.token_bytes(ids[-1])
        allowed = self.tokens_starting_with(removed)
        if allowed == [ids[-1]]:
            return ids, b"", []
        return ids[:-1], removed, allowed

    def _check_ids(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} out of range for vocab_size {self.vocab_size}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size}, fingerprint={self.fingerprint[:12]})"


def _as_ints(ids: Iterable[int]) -> list[int]:
    if hasattr(ids, "tolist"):  # torch / numpy
        ids = ids.tolist()
    return [int(i) for i in ids]


def check_message(index: int, message: Any, roles: Sequence[str] | None = CHAT_ROLES) -> tuple[str, str]:
    """(role, content) of ``messages[index]``, or a one-line ValueError naming what is wrong with it."""
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
    if "role" not in message or "content" not in message:
        raise ValueError(f"messages[{index}] needs 'role' and 'content' keys, got {list(message)}")
    role, content = message["role"], message["content"]
    if not isinstance(role, str) or (roles is not None and role not in roles):
        raise ValueError(f"messages[{index}] has unknown role {role!r}; allowed: {', '.join(roles or ())}")
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}] ({role}) content must be str, got {type(content).__name__}")
    return role, content


def resolve_tokenizer_spec(spec: str | Path, checkpoint: str | Path | None) -> str:
    """``spec`` as given, except 'auto': the tokenizer the checkpoint folder a stage starts from carries, else the
    bundled default (a folder that carries none is refused later, by ``trainer.checks.check_same_tokenizer``)."""
    if str(spec) != "auto":
        return str(spec)
    from data.tokenizer.files import find_tokenizer

    found = find_tokenizer(Path(checkpoint)) if checkpoint and Path(checkpoint).is_dir() else None
    # absolute: the config it is written into is read again from elsewhere (lantern export, a resumed pipeline)
    return str(found.absolute()) if found is not None else "default"


def load_tokenizer(spec: str | Path = "default") -> TokenizerBase:
    """'default' or 'auto' (the shipped Shakespeare 4096), 'cl100k_base', a tiktoken rank file, a Hugging Face tokenizer.json,
    or a checkpoint folder holding either (see ``data.tokenizer.files.tokenizer_file`` for which wins)."""
    from data.tokenizer.files import tokenizer_file
    from data.tokenizer.tokenizer import Tokenizer
    from models.formats.tokenizer_files import is_tokenizer_json

    if isinstance(spec, str) and spec == "cl100k_base":
        return Tokenizer.cl100k_base()
    path = tokenizer_file("default" if str(spec) == "auto" else spec)
    # the same test as the checkpoint writer's (as_tokenizer_files): a name ending in .json, else JSON content
    if is_tokenizer_json(path):
        from data.tokenizer.hf import HFTokenizer

        return HFTokenizer(path)
    return Tokenizer.from_file(path)


def check_utf8(path: str | Path) -> None:
    """Raise a DataError naming the file, line and byte offset of the first byte sequence that is not UTF-8
    (a gzip file is checked after decompression; its offsets count decompressed bytes)."""
    opener: Callable[..., Any] = open
    if str(path).endswith(".gz"):
        opener = gzip.open
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:  # the common, valid case at C speed, nothing kept: 64 KiB blocks, whose decoded copies stay in the CPU's
        # cache (16 MiB blocks made checking 100 MB of text ten times slower: 0.35 s against 0.03 s)
        with opener(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 16), b""):
                decoder.decode(block)
        decoder.decode(b"", final=True)
        return
    except UnicodeDecodeError:
        pass
    offset = 0
    with opener(path, "rb") as f:
        # "\n" never occurs inside a multi-byte UTF-8 sequence, so lines can be decoded one at a time
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                bad = raw[error.start : error.start + 4]
                raise DataError(
                    f"{path}: line {lineno}, byte offset {offset + error.start}: not valid UTF-8 ({bad!r}: "
                    f"{error.reason}); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            offset += len(raw)
    raise DataError(f"{path}: not valid UTF-8 (it ends inside a multi-byte character at byte offset {offset})")
