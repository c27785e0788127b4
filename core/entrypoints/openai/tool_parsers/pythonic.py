"""``pythonic`` (Llama 3.2 / Llama 4 and others): the reply is a Python list of calls, ``[get_weather(city="Paris"),
get_time()]`` (Llama 4 may wrap it in ``<|python_start|>``/``<|python_end|>``). Each call goes out whole once its
closing parenthesis is written, its keyword arguments as a JSON object; a reply that is not such a list is content."""

from __future__ import annotations

import ast
import json

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallStream, header

START_TAG, END_TAG = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolCallStream):
    def __init__(self, tools=None) -> None:
        super().__init__()
        self.text = ""  # the whole output so far
        self.mode: str | None = None  # "calls" | "content"
        self.scanned = 0  # text[:scanned] has been read
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False
        self.call_start: int | None = None
        self.pending: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        if self.mode is None:
            start = self.text.lstrip()
            if not start or (START_TAG.startswith(start) and len(start) < len(START_TAG)):
                return "", []
            if start.startswith(START_TAG):
                start = start[len(START_TAG):].lstrip()
            if not start:
                return "", []
            self.mode = "calls" if start.startswith("[") else "content"
            if self.mode == "content":
                return self.text, []
            self.scanned = self.text.index("[")
        if self.mode == "content":
            return text, []
        return "", self._scan()

    def _scan(self) -> list[dict]:
        deltas: list[dict] = []
        for i in range(self.scanned, len(self.text)):
            char = self.text[i]
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
                if self.depth == 2 and char == "(" and self.call_start is None:
                    self.call_start = self._name_start(i)
            elif char in ")]}":
                self.depth -= 1
                if self.depth == 1 and char == ")" and self.call_start is not None:
                    call = _call(self.text[self.call_start:i + 1])
                    self.call_start = None
                    if call is not None:
                        deltas.append(header(self.num_calls, *call))
                        self.num_calls += 1
        self.scanned = len(self.text)
        return deltas

    def _name_start(self, paren: int) -> int:
        start = paren
        while start > 0 and (self.text[start - 1].isalnum() or self.text[start - 1] in "_."):
            start -= 1
        return start

    def finish(self) -> tuple[str, list[dict]]:
        if self.mode is None:
            return self.text, []
        if self.mode == "calls" and not self.num_calls:
            return self.text, []  # never a call: the reply was text after all
        return "", []


def _call(source: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of ``name(key=value, ...)`` with literal values, or None."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        return name, json.dumps(arguments, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
