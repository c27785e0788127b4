"""``--reasoning-parser``: a thinking model's reasoning, written between ``<think>`` and ``</think>``, goes to the
message's ``reasoning_content``; the rest is its ``content`` (where tool calls are then looked for).

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output begins inside the reasoning
  (a ``<think>`` the model writes anyway is dropped); all of it is reasoning until ``</think>``.
- ``qwen3``: reasoning only when the output begins with ``<think>`` (with ``enable_thinking: false`` it does not).
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import split_at

START, END = "<think>", "</think>"


class ReasoningStream:
    """Text deltas in; (reasoning delta, content delta) out. Text that may be the start of a tag is held back."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.state = "start"  # "start" (the output's beginning undecided) | "reasoning" | "after" | "content"
        self.buffer = ""
        self.reasoned = False  # the output had a reasoning part

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        while self.buffer:
            if self.state == "start":
                head = self.buffer.lstrip()
                if START.startswith(head) and len(head) < len(START):
                    break  # may still become <think>
                if head.startswith(START):
                    self.buffer, self.state = head[len(START):], "reasoning"
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
                self.reasoned = self.state == "reasoning"
            elif self.state == "reasoning":
                before, self.buffer, found = split_at(self.buffer, END)
                reasoning += before
                if not found:
                    break
                self.state = "after"
            elif self.state == "after":  # the newlines templates put after </think> are not content
                self.buffer = self.buffer.lstrip("\n")
                if self.buffer:
                    self.state = "content"
            else:
                content, self.buffer = content + self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        if self.state == "start" and self.parser == "deepseek_r1":
            self.reasoned = True
            return rest, ""
        return "", rest


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """The whole output's (reasoning, or None when it had none; content)."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning if stream.reasoned else None), content + more_content
