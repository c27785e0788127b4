"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser NAME``), by the names vLLM gives them."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.bare_json import Llama3JsonParser, MistralParser
from pagedllm.entrypoints.openai.tool_parsers.base import ToolCallStream
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3XmlParser
from pagedllm.entrypoints.openai.tool_parsers.tagged_json import HermesParser

PARSERS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_xml": Qwen3XmlParser,
    "qwen3_coder": Qwen3XmlParser,
}
