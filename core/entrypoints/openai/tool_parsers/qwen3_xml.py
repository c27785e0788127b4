"""``qwen3_xml`` / ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): calls in XML-like blocks among the content::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The header goes out with ``<function=NAME>``, each parameter once its ``</parameter>`` is written (``{"city": "Paris"``,
then ``, "days": 3``...), and ``}`` at ``</function>``. Values are typed by the tool's parameter schema (a string stays
text; numbers, booleans, objects and arrays are read as JSON), as the model's own parser does."""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallStream, header, more_arguments, split_at

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = re.compile(r"\s*</function>")


class Qwen3XmlParser(ToolCallStream):
    def __init__(self, tools=None) -> None:
        super().__init__()
        self.schemas = {t.function.name: (t.function.parameters or {}).get("properties", {}) for t in tools or []}
        self.buffer = ""
        self.in_block = False
        self.block = ""  # the block's text not read yet
        self.raw = ""  # the whole block, for one that turns out not to be a call
        self.index: int | None = None  # of the call being read
        self.name = ""
        self.num_parameters = 0
        self.num_calls_in_block = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.in_block:
                before, self.buffer, found = split_at(self.buffer, OPEN)
                content += before
                if not found:
                    return content, deltas
                self.in_block, self.block, self.raw = True, "", ""
            piece, self.buffer, found = split_at(self.buffer, CLOSE)
            self.block += piece
            self.raw += piece
            deltas += self._read()
            if not found:
                return content, deltas
            if self.index is None and not self.num_calls_in_block:
                content += OPEN + self.raw + CLOSE  # not a call
            elif self.index is not None:  # no </function>: the call ends with its block
                deltas.append(more_arguments(self.index, "}" if self.num_parameters else "{}"))
            self.in_block, self.index, self.num_calls_in_block = False, None, 0

    def _read(self) -> list[dict]:
        deltas: list[dict] = []
        while True:
            if self.index is None:
                match = _FUNCTION.match(self.block)
                if match is None:
                    return deltas
                self.name = match.group(1).strip()
                self.index, self.num_parameters = self.num_calls, 0
                self.num_calls += 1
                self.num_calls_in_block += 1
                self.block = self.block[match.end():]
                deltas.append(header(self.index, self.name))
            match = _PARAMETER.match(self.block)
            if match is not None:
                key, value = match.group(1).strip(), _value(match.group(2), self.schemas.get(self.name, {}).get(
                    match.group(1).strip(), {}))
                prefix = "{" if not self.num_parameters else ", "
                deltas.append(more_arguments(self.index, f"{prefix}{json.dumps(key)}: "
                                                         f"{json.dumps(value, ensure_ascii=False)}"))
                self.num_parameters += 1
                self.block = self.block[match.end():]
                continue
            match = _FUNCTION_END.match(self.block)
            if match is None:
                return deltas
            deltas.append(more_arguments(self.index, "}" if self.num_parameters else "{}"))
            self.block, self.index = self.block[match.end():], None

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_block:
            return rest, []
        if self.index is None and not self.num_calls_in_block:
            return OPEN + self.raw, []
        if self.index is not None:
            return "", [more_arguments(self.index, "}" if self.num_parameters else "{}")]
        return "", []


def _value(text: str, schema: dict):
    """A parameter's text as its schema's type (one newline around it is the format's, not the value's)."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
