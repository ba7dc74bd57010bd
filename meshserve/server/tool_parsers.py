"""Tool calls read out of generated text (`--tool-call-parser`, vLLM's flag), one parser per choice.

A parser is fed the text as it streams and answers, each time, the content that may be shown now
and the calls completed so far; `finish()` gives the rest. Text that might still become a call is
held back, never streamed as content, and text that does not parse as a call stays content. A whole
answer is parsed by feeding it at once (`parse_tool_calls`), so a stream and a body always agree.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text
  (one object or a list of them per block); the text around them is the content.
- `json`: the whole answer is one such object, or a list of them; anything else is content.

The forced parsers read what a tool_choice constrained the output to (server/tools.py): the
arguments of the named function, or a list of `{"name", "parameters"}` for "required".
"""
from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass

DEFAULT_TOOL_PARSER = "hermes"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


Parsed = tuple[str, list[ParsedCall]]  # content to show, calls completed


class ToolParser:
    """Base: holds nothing back and finds no calls (what every subclass refines)."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self.tool_names = tool_names  # None: any name counts; otherwise a call must name one of these
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        return text, []

    def finish(self) -> Parsed:
        return "", []

    def _counted(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        self.num_calls += len(calls)
        return calls


def parse_tool_calls(parser: ToolParser, text: str) -> Parsed:
    """A whole answer: its content and calls, exactly what streaming it would have given."""
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    return content + rest, calls + more


def _arguments(item: dict, keys: tuple[str, ...]) -> dict | None:
    args = next((item[k] for k in keys if k in item), None)
    if args is None:
        return {}
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return args if isinstance(args, dict) else None


def calls_from_json(text: str, tool_names: Collection[str] | None,
                    keys: tuple[str, ...] = ("arguments", "parameters")) -> list[ParsedCall] | None:
    """`{"name": ..., "arguments"|"parameters": {...}}` or a non-empty list of them; None otherwise."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(name := item.get("name"), str):
            return None
        if tool_names is not None and name not in tool_names:
            return None
        args = _arguments(item, keys)
        if args is None:
            return None
        calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
    return calls or None


def _partial_open(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what to hold back)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesToolParser(ToolParser):
    """A model writes each block on its own lines: the whitespace after a call is dropped, and so is
    the whitespace before one that nothing but calls precedes, or that ends an answer that called a
    tool. Whitespace at the end of the content is held back until more content follows."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names)
        self._buf = ""
        self._inside = False  # after an opening tag, before its closing one
        self._space = ""  # trailing whitespace of the content, not shown yet
        self._shown = False  # some content was shown
        self._after_call = False  # no content since the last call

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._space + text
        shown = text.rstrip()
        self._space = text[len(shown):]
        self._shown = self._shown or bool(shown)
        return shown

    def _block(self, body: str, closed: bool) -> tuple[str, list[ParsedCall]]:
        calls = calls_from_json(body.strip(), self.tool_names)
        if calls is None:  # not a call: the block is content, tags and all
            return self._content(HERMES_OPEN + body + (HERMES_CLOSE if closed else "")), []
        if not self._shown:
            self._space = ""
        self._after_call = True
        return "", self._counted(calls)

    def feed(self, text: str) -> Parsed:
        self._buf += text
        shown, calls = [], []
        while True:
            if self._inside:
                end = self._buf.find(HERMES_CLOSE)
                if end < 0:
                    break
                content, found = self._block(self._buf[:end], closed=True)
                shown.append(content)
                calls += found
                self._buf, self._inside = self._buf[end + len(HERMES_CLOSE):], False
            else:
                start = self._buf.find(HERMES_OPEN)
                if start < 0:
                    keep = len(self._buf) - _partial_open(self._buf, HERMES_OPEN)
                    shown.append(self._content(self._buf[:keep]))
                    self._buf = self._buf[keep:]
                    break
                shown.append(self._content(self._buf[:start]))
                self._buf, self._inside = self._buf[start + len(HERMES_OPEN):], True
        return "".join(shown), calls

    def finish(self) -> Parsed:
        buf, self._buf = self._buf, ""
        if self._inside:  # an unclosed last block (the answer stopped at its end) still counts
            self._inside = False
            content, calls = self._block(buf, closed=False)
        else:
            content, calls = self._content(buf), []
        if not self.num_calls:  # whitespace at the very end is content, unless the answer called a tool
            content += self._space
        self._space = ""
        return content, calls


class JsonToolParser(ToolParser):
    """While the answer could still be JSON (it starts with `{` or `[`) nothing is shown."""

    keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names)
        self._held: list[str] = []
        self._plain = False  # the answer is not JSON: stream it as it comes

    def feed(self, text: str) -> Parsed:
        if self._plain:
            return text, []
        self._held.append(text)
        held = "".join(self._held)
        start = held.lstrip()
        if start and start[0] not in "{[":
            self._plain, self._held = True, []
            return held, []
        return "", []

    def finish(self) -> Parsed:
        text, self._held = "".join(self._held), []
        calls = calls_from_json(text, self.tool_names, self.keys) if text.strip() else None
        return ("", self._counted(calls)) if calls else (text, [])


class RequiredToolParser(JsonToolParser):
    """tool_choice "required": a list of `{"name", "parameters"}` (held back whole)."""

    keys = ("parameters",)

    def feed(self, text: str) -> Parsed:
        self._held.append(text)
        return "", []


class NamedToolParser(ToolParser):
    """A named tool_choice: the answer is the arguments of `name` (held back whole)."""

    def __init__(self, name: str) -> None:
        super().__init__((name,))
        self.name = name
        self._held: list[str] = []

    def feed(self, text: str) -> Parsed:
        self._held.append(text)
        return "", []

    def finish(self) -> Parsed:
        text, self._held = "".join(self._held), []
        calls = calls_from_json(json.dumps({"name": self.name, "arguments": text}), self.tool_names)
        return ("", self._counted(calls)) if calls else (text, [])


TOOL_PARSERS: dict[str, Callable[[Collection[str] | None], ToolParser]] = {
    "hermes": HermesToolParser,
    "json": JsonToolParser,
}
