"""What every tool-call parser shares: the stream interface, OpenAI's delta entries, and reading a call written as a
JSON object ({"name": ..., "arguments": {...}}) as it is generated, its arguments streamed as the model writes them.

A parser turns text deltas into (content delta, ``tool_calls`` delta entries): the first entry of a call carries its
index, id, type and name; the next ones more of its arguments. Text that may still turn into a call is held back.
"""

from __future__ import annotations

import json
import re
import uuid

_WHITESPACE = " \t\r\n"
_PRIMITIVE = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def header(index: int, name: str, arguments: str = "") -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def more_arguments(index: int, arguments: str) -> dict:
    return {"index": index, "function": {"arguments": arguments}}


def arguments_text(value) -> str:
    """A call's arguments as OpenAI sends them: JSON text (a model that wrote them as a string meant that text)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag`` (held back until the next delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_at(text: str, tag: str) -> tuple[str, str, bool]:
    """(text before ``tag``, text after it, True) if ``text`` holds the tag; else (what cannot be part of it, the
    end that may begin it, held back for the next delta, False)."""
    at = text.find(tag)
    if at >= 0:
        return text[:at], text[at + len(tag):], True
    keep = partial_suffix(text, tag)
    return text[:len(text) - keep], text[len(text) - keep:], False


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that begins at ``text[start]`` (after whitespace); None while it is not
    complete."""
    return JsonScanner(start).scan(text)


class JsonScanner:
    """Finds where a JSON value ends in a growing text, reading each character once: a scan, not a parse, so
    nesting of any depth costs no recursion."""

    def __init__(self, start: int = 0) -> None:
        self.position = start
        self.started = False
        self.primitive = False
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        """The end of the value in ``text`` (the same text as before, grown), once it is complete."""
        if self.end is not None:
            return self.end
        i = self.position
        while not self.started and i < len(text):
            if text[i] not in _WHITESPACE:
                self.started, self.primitive = True, text[i] not in '{["'
                break
            i += 1
        if not self.started:
            self.position = i
            return None
        if self.primitive:
            match = _PRIMITIVE.match(text, i)
            self.position = i
            if match and match.end() < len(text):
                self.end = match.end()
            return self.end
        for j in range(i, len(text)):
            if self.step(text[j]):
                self.end = j + 1
                return self.end
        self.position = len(text)
        return None

    def step(self, char: str) -> bool:
        """Take one character of a string, object or array; True if it ends the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                return self.depth == 0
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class ToolCallStream:
    """Text deltas in; (content delta, tool_calls delta entries) out. ``num_calls`` counts the calls begun."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the output: what was held back."""
        return "", []

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason


class JsonCallReader:
    """One call written as a JSON object. Its header goes out once the name is written and the arguments begin
    (``"name"`` first, as models write it); then the arguments' text as it comes. An object that names its
    arguments first is read whole once complete (``close``)."""

    def __init__(self, stream: ToolCallStream) -> None:
        self.stream = stream
        self.text = ""
        self.index: int | None = None  # set when the header went out
        self._arguments_at = 0
        self._sent = 0
        self._object = JsonScanner()
        self._arguments: JsonScanner | None = None

    @property
    def started(self) -> bool:
        return self.index is not None

    def feed(self, text: str) -> list[dict]:
        self.text += text
        deltas: list[dict] = []
        if self.index is None:
            match = _CALL_HEAD.match(self.text)
            if match is None:
                return deltas
            try:
                name = json.loads(match.group(1))
            except ValueError:
                return deltas
            self.index = self.stream.num_calls
            self.stream.num_calls += 1
            self._arguments_at = self._sent = match.end()
            deltas.append(header(self.index, name))
        start = self._arguments_at
        while start < len(self.text) and self.text[start] in _WHITESPACE:
            start += 1
        if start == len(self.text):
            return deltas
        self._arguments_at = start
        self._sent = max(self._sent, start)
        if self._arguments is None:
            self._arguments = JsonScanner(start)
        end = self._arguments.scan(self.text)
        if self.text[start] == '"':  # a JSON string holding the arguments' text: sent once it is complete
            if end is not None and self._sent < end:
                deltas.append(more_arguments(self.index, _string_value(self.text[start:end])))
                self._sent = end
            return deltas
        stop = end if end is not None else len(self.text)
        if stop > self._sent:
            deltas.append(more_arguments(self.index, self.text[self._sent:stop]))
            self._sent = stop
        return deltas

    def end(self) -> int | None:
        """Where the whole object ends in the text read, if it has."""
        return self._object.scan(self.text)

    def close(self) -> list[dict] | None:
        """The object is over: for one whose header never went out, the whole call if it is one (else None)."""
        if self.started:
            return []
        try:
            parsed = json.loads(self.text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return None
        self.index = self.stream.num_calls
        self.stream.num_calls += 1
        return [header(self.index, parsed["name"],
                       arguments_text(parsed.get("arguments", parsed.get("parameters", {}))))]


def _string_value(literal: str) -> str:
    try:
        return json.loads(literal)
    except ValueError:
        return literal
