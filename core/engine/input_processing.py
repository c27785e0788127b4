"""Prompts as the engine takes them: text or token ids in, (text, token ids) out, and conversations rendered with
a chat template. Needs only a tokenizer: the front ends import it without torch, the scheduler or the plugins."""

from __future__ import annotations

import json

from pagedllm.errors import InvalidRequestError

PromptType = str | list[int] | dict  # text, token ids, or {"prompt": text} / {"prompt_token_ids": ids, ...}


def tokenize_prompt(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string, a list of token ids, or a dict with either."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise InvalidRequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}",
                              param="prompt")


def needs_tokenizing(prompt: PromptType) -> bool:
    """Whether the prompt is text only (no token ids given)."""
    return isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)


def render_chat(tokenizer, conversation: list[dict], chat_template: str | None = None,
                add_generation_prompt: bool = True, add_special_tokens: bool = False, **template_kwargs) -> dict:
    """A conversation as a prompt: the chat template's text and its token ids. The template writes the special
    tokens it wants, so none are added by default (as vLLM and ``LLM.chat`` do)."""
    if template_kwargs.get("continue_final_message"):
        add_generation_prompt = False  # the reply goes on in the last message, not in a new one
    text = tokenizer.apply_chat_template([_with_parsed_arguments(m) for m in conversation],
                                         chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=add_special_tokens).input_ids}


def _with_parsed_arguments(message: dict) -> dict:
    """An assistant message's tool calls with their ``arguments`` as objects, not JSON text: OpenAI's clients send
    text, and templates iterate the arguments (``arguments | items``), as vLLM hands them over."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except (ValueError, RecursionError):
                value = None
            if isinstance(value, dict):
                call = {**call, "function": {**function, "arguments": value}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}
