"""Calls written as bare JSON objects in place of the reply:

- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): ``{"name": ..., "parameters": {...}}``, several separated by
  ``;``, optionally after ``<|python_tag|>``;
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name": ..., "arguments": {...}}`` (or, with the
  newer tokenizers, ``[TOOL_CALLS]name[ARGS]{...}`` per call).

An output that does not begin as calls is content.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    JsonCallReader,
    ToolCallStream,
    header,
    json_value_end,
    more_arguments,
    split_at,
)

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class _JsonObjects(ToolCallStream):
    """Reads JSON call objects one after another (``separators`` and whitespace may come between them); from the
    first text that is not one on, the rest is content."""

    separators = ";"

    def __init__(self) -> None:
        super().__init__()
        self.reader: JsonCallReader | None = None
        self.content_from_here = False

    def read(self, text: str) -> tuple[str, list[dict]]:
        """(content, deltas): content is what followed the calls, once something other than a call came."""
        deltas: list[dict] = []
        while True:
            if self.content_from_here:
                return text, deltas
            if self.reader is None:
                text = text.lstrip(" \t\r\n" + self.separators)
                if not text:
                    return "", deltas
                if text[0] != "{":
                    self.content_from_here = True
                    continue
                self.reader = JsonCallReader(self)
            deltas += self.reader.feed(text)
            end = self.reader.end()
            if end is None:
                return "", deltas
            reader, self.reader = self.reader, None
            text, reader.text = reader.text[end:], reader.text[:end]
            closed = reader.close()
            if closed is None:  # not a call after all: it and what follows are content
                self.content_from_here = True
                text = reader.text + text
            else:
                deltas += closed

    def end_of_calls(self) -> tuple[str, list[dict]]:
        """An object left open at the end: a call if it began as one (cut by max_tokens), else content."""
        if self.reader is None:
            return "", []
        reader, self.reader = self.reader, None
        closed = reader.close()
        return ("", closed) if closed is not None else (reader.text, [])


class Llama3JsonParser(_JsonObjects):
    def __init__(self, tools=None) -> None:
        super().__init__()
        self.head = ""  # the output's start, until it says whether it is calls
        self.mode: str | None = None  # "calls" | "content"

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.mode is None:
            self.head += text
            start = self.head.lstrip()
            if not start or (PYTHON_TAG.startswith(start) and len(start) < len(PYTHON_TAG)):
                return "", []
            if start.startswith(PYTHON_TAG):
                start = start[len(PYTHON_TAG):].lstrip()
                if not start:
                    return "", []
            self.mode = "calls" if start.startswith("{") else "content"
            text, self.head = (start if self.mode == "calls" else self.head), ""
        if self.mode == "content":
            return text, []
        return self.read(text)

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode is None:
            return self.head, []
        return self.end_of_calls() if self.mode == "calls" else ("", [])


class MistralParser(_JsonObjects):
    separators = ","

    def __init__(self, tools=None) -> None:
        super().__init__()
        self.buffer = ""
        self.state = "content"  # "content" | "start" (after [TOOL_CALLS]) | "array" | "named"
        self.name = ""  # [TOOL_CALLS]name[ARGS]: the name until [ARGS]
        self.index: int | None = None  # of the named call whose arguments are being read
        self.arguments = ""
        self.sent = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, deltas = "", []
        while self.buffer:
            if self.state == "content":
                before, self.buffer, found = split_at(self.buffer, TOOL_CALLS)
                content += before
                if not found:
                    break
                self.state = "start"
            elif self.state == "start":
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    break
                self.state = "array" if self.buffer.startswith("[") else "named"
                self.buffer = self.buffer[1:] if self.state == "array" else self.buffer
            elif self.state == "array":
                rest, new = self.read(self.buffer)
                self.buffer = ""
                deltas += new
                if self.content_from_here:  # the array's end: what follows is content again
                    self.content_from_here, self.state = False, "content"
                    rest = rest.lstrip()
                    self.buffer = rest[1:] if rest.startswith("]") else rest
            else:
                deltas += self._named()
        return content, deltas

    def _named(self) -> list[dict]:
        """``name[ARGS]{json}``, read from the buffer; what follows the call stays in it."""
        deltas: list[dict] = []
        if self.index is None:
            self.name, self.buffer = self.name + self.buffer, ""
            at = self.name.find(ARGS)
            if at < 0:
                return deltas
            name, self.buffer = self.name[:at].strip(), self.name[at + len(ARGS):]
            self.index, self.name, self.arguments, self.sent = self.num_calls, "", "", 0
            self.num_calls += 1
            deltas.append(header(self.index, name))
        self.arguments, self.buffer = self.arguments + self.buffer, ""
        self.sent = max(self.sent, len(self.arguments) - len(self.arguments.lstrip()))
        end = json_value_end(self.arguments, 0)
        stop = end if end is not None else len(self.arguments)
        if stop > self.sent:
            deltas.append(more_arguments(self.index, self.arguments[self.sent:stop]))
            self.sent = stop
        if end is not None:
            self.buffer, self.index = self.arguments[end:], None
            self.state = "content"
        return deltas

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if self.state == "content":
            return rest, []
        if self.state == "array":
            return self.end_of_calls()
        return "", []
