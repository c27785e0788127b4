"""``hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` among the content (Hermes, Qwen2.5,
Qwen3 and most chat models' templates). A block whose text is not a call stays in the content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import JsonCallReader, ToolCallStream, split_at

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallStream):
    def __init__(self, tools=None) -> None:
        super().__init__()
        self.buffer = ""
        self.reader: JsonCallReader | None = None  # set inside a block

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if self.reader is None:
                before, self.buffer, found = split_at(self.buffer, OPEN)
                content += before
                if not found:
                    return content, deltas
                self.reader = JsonCallReader(self)
            piece, self.buffer, found = split_at(self.buffer, CLOSE)
            deltas += self.reader.feed(piece)
            if not found:
                return content, deltas
            closed = self.reader.close()
            if closed is None:
                content += OPEN + self.reader.text + CLOSE
            else:
                deltas += closed
            self.reader = None

    def finish(self) -> tuple[str, list[dict]]:
        """An unclosed block: a call if it began as one or its JSON is complete (the model stopped before the tag)."""
        rest, self.buffer = self.buffer, ""
        if self.reader is None:
            return rest, []
        reader, self.reader = self.reader, None
        deltas = reader.feed(rest)
        closed = reader.close()
        if closed is None:
            return OPEN + reader.text, []
        return "", deltas + closed
