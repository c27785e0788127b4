"""``pythonic`` (Llama 3.2 / Llama 4, LFM2 and others): calls written as a Python list, ``[get_weather(city="Paris"),
get_time()]``. Llama models write the list as the whole reply (Llama 4 may wrap it in ``<|python_start|>`` /
``<|python_end|>``); LFM2 wraps it in ``<|tool_call_start|>`` / ``<|tool_call_end|>``, with text before or after it.
A call's header goes out at its ``(``, then each keyword argument once written, as members of a JSON object;
a list that holds no call, and all text outside the lists, is content."""

from __future__ import annotations

import ast
import json

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallStream, header, more_arguments, partial_suffix

# the start tag and end tag of each wrapper a list may come in: Llama 4's, LFM2's
WRAPPERS = {"<|python_start|>": "<|python_end|>", "<|tool_call_start|>": "<|tool_call_end|>"}


class PythonicParser(ToolCallStream):
    """A small state machine over the text not yet given out (``held``):
    ``start`` (the reply's beginning: a bare list or a tag), ``content`` (text, watching for a tag), ``open`` (after a
    tag, before its list), ``list`` (inside one), ``close`` (after a tagged list, before its end tag)."""

    def __init__(self, tools=None) -> None:
        super().__init__()
        # only the request's tools are called: "[Source(Wikipedia)] says..." is text
        self.names = {tool.function.name for tool in tools} if tools else None
        self.mode = "start"
        self.held = ""
        self.block = ""  # the tag and list read so far: content after all if the list holds no call
        self.block_calls = 0  # num_calls when the block's list began
        self.end_tag: str | None = None
        self.scanned = 0  # held[:scanned] of the list has been read
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False
        self.call: int | None = None  # the index of the call being read
        self.argument_start = 0
        self.arguments_sent = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        content: list[str] = []
        deltas: list[dict] = []
        while getattr(self, "_" + self.mode)(content, deltas):
            pass
        return "".join(content), deltas

    def _start(self, content: list[str], deltas: list[dict]) -> bool:
        text = self.held.lstrip()
        if not text or any(len(text) < len(tag) and tag.startswith(text) for tag in WRAPPERS):
            return False
        if text.startswith("["):
            self._begin_list()
            return True
        for tag in WRAPPERS:
            if text.startswith(tag):
                self._begin_block(tag)  # the whitespace before it too
                return True
        self.mode = "content"
        return True

    def _content(self, content: list[str], deltas: list[dict]) -> bool:
        found = [(self.held.find(tag), tag) for tag in WRAPPERS if tag in self.held]
        if found:
            at, tag = min(found)
            content.append(self.held[:at])
            self.held = self.held[at:]
            self._begin_block(tag)
            return True
        keep = max(partial_suffix(self.held, tag) for tag in WRAPPERS)
        content.append(self.held[:len(self.held) - keep])
        self.held = self.held[len(self.held) - keep:]
        return False

    def _open(self, content: list[str], deltas: list[dict]) -> bool:
        text = self.held.lstrip()
        if not text:
            return False
        if text.startswith("["):
            self._begin_list()
        else:  # a tag that opens no list: text
            content.append(self.block)
            self.block, self.end_tag, self.mode = "", None, "content"
        return True

    def _list(self, content: list[str], deltas: list[dict]) -> bool:
        end = self._scan(deltas)
        if end is None:
            return False
        self.block += self.held[:end]
        self.held = self.held[end:]
        if self.num_calls == self.block_calls:  # a list of no call, as "[1]": text, its end tag too
            content.append(self.block)
            self.end_tag = None
        self.block = ""
        self.mode = "close" if self.end_tag else "content"
        return True

    def _close(self, content: list[str], deltas: list[dict]) -> bool:
        text = self.held.lstrip()
        if len(text) < len(self.end_tag) and self.end_tag.startswith(text):
            return False
        if text.startswith(self.end_tag):
            self.held = text[len(self.end_tag):]
        self.end_tag, self.mode = None, "content"
        return True

    def _begin_block(self, tag: str) -> None:
        """The held text up to and with its first ``tag`` becomes the block; the list is looked for after it."""
        end = self.held.index(tag) + len(tag)
        self.block, self.held = self.held[:end], self.held[end:]
        self.end_tag, self.mode = WRAPPERS[tag], "open"

    def _begin_list(self) -> None:
        """The held text before its ``[`` joins the block; the list is read from there."""
        at = self.held.index("[")
        self.block, self.held = self.block + self.held[:at], self.held[at:]
        self.block_calls = self.num_calls
        self.mode, self.scanned, self.depth, self.quote, self.escaped, self.call = "list", 0, 0, None, False, None

    def _scan(self, deltas: list[dict]) -> int | None:
        """Reads the list on from ``scanned``, sending each call's header at its ``(`` and each keyword argument
        once written; the list's end, once written."""
        text = self.held
        for i in range(self.scanned, len(text)):
            char = text[i]
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote:
                    self.quote = None
                continue
            if char in "'\"":
                self.quote = char
            elif char in "([{":
                self.depth += 1
                if self.depth == 2 and char == "(":
                    self._open_call(text, i, deltas)
            elif char == "," and self.depth == 2 and self.call is not None:
                self._argument(text[self.argument_start:i], deltas)
                self.argument_start = i + 1
            elif char in ")]}":
                self.depth -= 1
                if self.depth < 2 and self.call is not None:  # its ")", or a bracket that closes it anyway
                    self._close_call(text[self.argument_start:i], deltas)
                if self.depth == 0:
                    return i + 1
        self.scanned = len(text)
        return None

    def _open_call(self, text: str, paren: int, deltas: list[dict]) -> None:
        """``name(`` as an element of the list (after its ``[`` or a comma) begins a call."""
        start = paren
        while start > 0 and (text[start - 1].isalnum() or text[start - 1] in "_."):
            start -= 1
        name = text[start:paren]
        if not name or not all(part.isidentifier() for part in name.split(".")):
            return
        if self.names is not None and name not in self.names:
            return
        if not text[:start].rstrip().endswith(("[", ",")):
            return
        deltas.append(header(self.num_calls, name))
        self.call, self.num_calls = self.num_calls, self.num_calls + 1
        self.argument_start, self.arguments_sent = paren + 1, 0

    def _argument(self, source: str, deltas: list[dict]) -> None:
        """One ``key=value`` written: sent as the next member of the arguments' JSON object."""
        for key, value in _keywords(source):
            opening = "{" if not self.arguments_sent else ", "
            deltas.append(more_arguments(self.call, f"{opening}{json.dumps(key)}: {value}"))
            self.arguments_sent += 1

    def _close_call(self, source: str, deltas: list[dict]) -> None:
        self._argument(source, deltas)
        deltas.append(more_arguments(self.call, "}" if self.arguments_sent else "{}"))
        self.call = None

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode == "list" and self.num_calls > self.block_calls:
            deltas: list[dict] = []
            if self.call is not None:  # cut off inside a call: its arguments so far, as a whole object
                self._close_call(self.held[self.argument_start:], deltas)
            return "", deltas
        if self.mode == "close" and self.end_tag.startswith(self.held.strip()):
            return "", []
        return self.block + self.held, []


def _keywords(source: str) -> list[tuple[str, str]]:
    """The ``key=value`` pairs in ``source`` (one argument, or none), each value as JSON text: a literal as its JSON,
    anything else (a name, an expression) as its source text in a string. Positional arguments have no name: left
    out."""
    if not source.strip():
        return []
    try:
        node = ast.parse(f"f({source})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    pairs = []
    for keyword in node.keywords:
        if keyword.arg is None:
            continue
        try:
            value = json.dumps(ast.literal_eval(keyword.value), ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            value = json.dumps(ast.unparse(keyword.value), ensure_ascii=False)
        pairs.append((keyword.arg, value))
    return pairs
