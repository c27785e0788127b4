"""Tool calling on chat completions: which output the tools ask for, and the tool calls read back out of the text.

- ``tool_choice`` a named function: the output is held (by a grammar) to that function's parameters schema; the whole
  output is the call's arguments.
- ``"required"``: the output is held to a JSON array of ``{"name": ..., "parameters": {...}}``, one of the functions
  each; every element is a call.
- ``"auto"`` (with ``--enable-auto-tool-choice --tool-call-parser NAME``): the model writes freely; the calls are
  read out of its text as its family writes them (``tool_parsers``), the rest is content.
- ``"none"``, or no tools: plain text.

One ``ToolCallStream`` per choice turns text deltas into OpenAI's deltas (content and/or ``tool_calls`` entries: the
first for a call carries its id, type and name, the next ones more of its arguments). A whole response runs the
same stream over the whole text, so streamed and whole responses say the same.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.tool_parsers import PARSERS
from pagedllm.entrypoints.openai.tool_parsers.base import JsonScanner, ToolCallStream, header, more_arguments
from pagedllm.sampling_params import StructuredOutputsParams

_REQUIRED_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "parameters": ')
_NO_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``; a tool has the same shape with the whole definition."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: _FunctionName


class ChatTool(NamedToolChoice):
    function: FunctionDefinition


class ToolFields(BaseModel):
    """Mixed into the chat completion request body."""

    model_config = ConfigDict(extra="allow", strict=True)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class ToolCalling:
    """What a request's tools ask for: the constraint on the output (named, required), the template's tools, and
    the parsing of the output."""

    def __init__(self, mode: str, tools: list[ChatTool], name: str | None = None,
                 parallel_tool_calls: bool = True, parser: str | None = None) -> None:
        self.mode = mode  # "named" | "required" | "auto"
        self.tools = tools
        self.name = name
        self.parallel_tool_calls = parallel_tool_calls
        self.parser = parser  # for "auto": how the model writes calls

    @classmethod
    def for_request(cls, body: ToolFields, parser: str | None) -> "ToolCalling | None":
        """None when the output is plain text; 400 for a tool_choice the tools or the server cannot serve.
        ``parser`` is the server's auto tool-call parser (None: auto tool choice is off)."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        parallel = body.parallel_tool_calls is not False
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in body.tools]
            if choice.function.name not in names:
                raise OpenAIError(400, f"tool_choice names the function {choice.function.name!r}, which is not "
                                       f"among the tools ({', '.join(map(repr, names))})", param="tool_choice")
            return cls("named", body.tools, choice.function.name, parallel)
        if choice == "required":
            return cls("required", body.tools, None, parallel)
        if parser is None:  # "auto", given or by default
            raise OpenAIError(400, 'tool_choice "auto" (the default with tools) needs the server started with '
                                   '--enable-auto-tool-choice --tool-call-parser NAME; or send tool_choice '
                                   '"required", a named function, or "none"', param="tool_choice")
        return cls("auto", body.tools, None, parallel, parser)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar the output follows: the named function's parameters, or an array of calls."""
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._function(self.name)))
        if self.mode == "required":
            calls = [{"type": "object",
                      "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                     "parameters": _parameters(t.function)},
                      "required": ["name", "parameters"]} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel_tool_calls:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def template_fields(self, body: BaseModel) -> BaseModel:
        """The request with the tools added to its chat_template_kwargs, for templates that describe them."""
        kwargs = {"tools": [t.model_dump(exclude_none=True) for t in self.tools], **(body.chat_template_kwargs or {})}
        return body.model_copy(update={"chat_template_kwargs": kwargs})

    def stream(self) -> "ToolCallStream":
        if self.mode == "named":
            return _NamedStream(self.name)
        if self.mode == "required":
            return _RequiredStream()
        return PARSERS[self.parser](self.tools)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole response's message and finish reason."""
        stream = self.stream()
        content, deltas = stream.feed(text)
        more_content, more_deltas = stream.finish()
        calls: list[dict] = []
        for delta in deltas + more_deltas:
            if "id" in delta:
                calls.append({"id": delta["id"], "type": "function", "function": dict(delta["function"])})
            else:
                calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
        content += more_content
        message = {"role": "assistant", "content": (content if content.strip() else None) if calls else content}
        if calls:
            message["tool_calls"] = calls
        return message, stream.finish_reason(finish_reason)

    def _function(self, name: str) -> FunctionDefinition:
        return next(t.function for t in self.tools if t.function.name == name)


def _parameters(function: FunctionDefinition) -> dict:
    return function.parameters if function.parameters else _NO_PARAMETERS


class _NamedStream(ToolCallStream):
    """The whole output is the arguments of one call."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if not self.num_calls:
            self.num_calls = 1
            return "", [header(0, self.name, text)]
        return "", [more_arguments(0, text)] if text else []

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("") if not self.num_calls else ("", [])


class _RequiredStream(ToolCallStream):
    """``[{"name": "f", "parameters": {...}}, ...]`` in the grammar's compact form: a call's header once its name is
    complete, then its arguments as they come. What is left unfinished at the end (max_tokens) is content."""

    def __init__(self) -> None:
        super().__init__()
        self.scanner = JsonScanner()  # its depth: 1 in the array, 2 in an element
        self.item = ""  # the current element's text up to its arguments
        self.in_arguments = False
        self.unfinished = ""  # all text since the last complete element

    def feed(self, text: str) -> tuple[str, list[dict]]:
        deltas: list[dict] = []
        arguments = ""
        for char in text:
            self.unfinished += char
            scanner = self.scanner
            closes_item = not scanner.in_string and char == "}" and scanner.depth == 2
            scanner.step(char)
            if self.in_arguments:
                if closes_item:
                    self._flush(deltas, arguments)
                    arguments, self.in_arguments, self.item, self.unfinished = "", False, "", ""
                else:
                    arguments += char
            elif scanner.depth >= 2 or closes_item:
                self.item += char
                match = _REQUIRED_HEADER.fullmatch(self.item)
                if match:
                    deltas.append(header(self.num_calls, json.loads(match.group(1))))
                    self.num_calls += 1
                    self.in_arguments = True
            elif scanner.depth == 0 and char == "]":
                self.unfinished = ""
        self._flush(deltas, arguments)
        return "", deltas

    def _flush(self, deltas: list[dict], arguments: str) -> None:
        if not arguments:
            return
        if deltas and deltas[-1]["index"] == self.num_calls - 1:
            deltas[-1]["function"]["arguments"] += arguments
        else:
            deltas.append(more_arguments(self.num_calls - 1, arguments))

    def finish(self) -> tuple[str, list[dict]]:
        return ("" if self.num_calls else self.unfinished), []
