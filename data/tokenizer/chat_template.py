"""
Chat templates as Hugging Face checkpoints ship them: jinja2 source rendered the way transformers'
``apply_chat_template`` renders it, and the character spans of the assistant turns it writes.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Private-use code points that mark where a {% generation %} block starts and ends in the rendered text; they are
# removed before the text is tokenized.
_GEN_START, _GEN_END = "\ue000", "\ue001"
_MARK = "\ue002"  # an assistant turn's content, swapped in to find where the turn is in a rendering


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: the body, wrapped in the span markers."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        return _GEN_START + caller() + _GEN_END


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # transformers' filter: jinja's own escapes HTML characters, which a prompt must keep as they are
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace without underscore-prefixed names (no way to reach CPython internals through it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed names ({name!r})")


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


class ChatTemplateError(ValueError):
    """A template that cannot render a conversation, or whose assistant turns cannot be found."""


class ChatTemplate:
    """A jinja2 chat template with the special-token strings it is rendered with (``bos_token``, ``eos_token`` ...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], where: str = "chat template"):
        self.source = source
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.where = where
        try:
            self._template = _compile(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"{where}: not a valid jinja2 template ({error})") from None
        self.has_generation_tags = "generation" in source and "endgeneration" in source

    def __getstate__(self) -> dict[str, Any]:  # worker processes get the source and compile it again
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._template = _compile(self.source)

    def _render_marked(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, tools: Sequence[Mapping] | None = None
    ) -> str:
        # None-valued keys are dropped, as transformers does: templates test for a key, not for None.
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=chat,
                tools=list(tools) if tools else None,  # as transformers passes them: None when there are none
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"{self.where}: {error}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The conversation as text, as ``apply_chat_template(..., tokenize=False, tools=tools)`` gives it; ``tools``:
        the functions the model may call, in OpenAI's format (``Tool.schema()``)."""
        marked = self._render_marked(messages, add_generation_prompt, tools)
        return marked.replace(_GEN_START, "").replace(_GEN_END, "")

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template writes the tools it is given (Qwen's, Llama 3.1's do; SmolLM2-135M's ignores them,
        so tools must then be described in the conversation itself)."""
        probe = [{"role": "user", "content": "x"}]
        tool = {"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {}}}
        try:
            return self.render(probe, True, [tool]) != self.render(probe, True)
        except ChatTemplateError:
            return False

    def render_with_spans(
        self, messages: Sequence[Mapping[str, Any]], end_of_turn: str, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, the [start, end) character spans of the assistant turns in it, each through its ``end_of_turn``
        string): the template's own ``{% generation %}`` markers, else each turn found by rendering around it."""
        if self.has_generation_tags:
            return _strip_markers(self._render_marked(messages, False, tools))
        text = self.render(messages, tools=tools)
        turns = [index for index, message in enumerate(messages) if message.get("role") == "assistant"]
        return text, [self._turn_span(messages, index, text, end_of_turn, tools) for index in turns]

    def _turn_span(
        self,
        messages: Sequence[Mapping[str, Any]],
        index: int,
        text: str,
        end_of_turn: str,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[int, int]:
        """Assistant turn ``index`` is where the conversation before it, with the generation prompt, ends, through
        where the conversation through it ends, when both are prefixes of the whole. A template that renders turns
        otherwise once later messages follow (Qwen3 drops the thinking of turns before the last user message, and
        writes an empty think block only in the last turn) is measured in the whole: rendered again with the turn's
        content swapped for a marker, the two texts differ only inside the turn, which ends at the first
        ``end_of_turn`` after the difference."""
        before = self.render(messages[:index], add_generation_prompt=True, tools=tools) if index else ""
        through = self.render(messages[: index + 1], tools=tools)
        if text.startswith(before) and through.startswith(before) and text.startswith(through):
            return len(before), len(through)
        marked = [*messages[:index], {"role": "assistant", "content": _MARK}, *messages[index + 1 :]]
        swapped = self.render(marked, tools=tools)
        common = min(len(text), len(swapped))
        prefix = next((i for i in range(common) if text[i] != swapped[i]), common)
        suffix = next((i for i in range(common - prefix) if text[-1 - i] != swapped[-1 - i]), common - prefix)
        end = text.find(end_of_turn, len(text) - suffix)
        if swapped.count(_MARK) != 1 or _MARK not in swapped[prefix : len(swapped) - suffix] or end < 0:
            raise ChatTemplateError(
                f"{self.where} renders a conversation so that its assistant turns cannot be found (turn {index}); "
                "add {% generation %} markers to it"
            )
        start = len(before) if text.startswith(before) and len(before) <= prefix else prefix
        return start, end + len(end_of_turn)


def _strip_markers(marked: str) -> tuple[str, list[tuple[int, int]]]:
    text, spans, length, start = [], [], 0, 0
    for piece in re.split(f"([{_GEN_START}{_GEN_END}])", marked):
        if piece == _GEN_START:
            start = length
        elif piece == _GEN_END:
            spans.append((start, length))
        else:
            text.append(piece)
            length += len(piece)
    return "".join(text), spans
