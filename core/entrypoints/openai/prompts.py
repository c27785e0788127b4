"""Request inputs → engine prompts (text and token ids), off the event loop.

Tokenizing and rendering chat templates run in a small pool of threads (``run``), each with a tokenizer of its own
(a Hugging Face tokenizer must not be used by two threads at once), so a long prompt holds no other request. Text
that cannot fit ``max_model_len`` whatever it tokenizes to (more bytes than ``max_model_len`` of the vocabulary's
longest tokens) is refused before any tokenizing. Token ids match what ``LLM.generate``/``LLM.chat`` feed the engine
for the same input, so greedy output through the server equals the offline API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Callable

import jinja2

from pagedllm.engine.input_processing import render_chat
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatMessage, ChatTemplateFields

TOKENIZER_THREADS = 2


class PromptBuilder:
    def __init__(self, load_tokenizer: Callable[[], object], max_model_len: int, vocab_size: int,
                 chat_template: str | None = None, max_prompts: int = 1024) -> None:
        self._load_tokenizer = load_tokenizer
        self._local = threading.local()
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.chat_template = chat_template
        self.max_prompts = max_prompts
        self._pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pagedllm-tokenize")
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        # The most UTF-8 bytes one token can stand for (its vocabulary entry's, an upper bound): text longer than
        # max_model_len of them cannot fit.
        self.max_text_bytes = max_model_len * max(len(t.encode("utf-8")) for t in self.tokenizer.get_vocab())

    @property
    def tokenizer(self):
        """This thread's own tokenizer."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = self._load_tokenizer()
        return tokenizer

    async def run(self, fn, *args, **kwargs):
        """``fn(*args)`` on the tokenizer pool: the event loop goes on serving meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _token_text(self, token_id: int) -> str:
        """A single token's text, as logprobs name it."""
        return self.tokenizer.decode([token_id])

    def completion_prompts(self, prompt: str | list) -> list[dict]:
        """The prompts of a completion request: a string, a list of strings, token ids, or lists of token ids."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise OpenAIError(400, "prompt is empty: give a string, a list of strings or token ids", param="prompt")
        if len(prompts) > self.max_prompts:
            raise OpenAIError(400, f"prompt is a list of {len(prompts)} prompts, more than the {self.max_prompts} "
                                   f"allowed (--max-prompts-per-request)", param="prompt")
        for p in prompts:
            self.check_length(p, "prompt")
        return [self.encode(p, add_special_tokens=True) if isinstance(p, str) else self.from_ids(p) for p in prompts]

    def check_length(self, prompt: str | list[int], param: str) -> None:
        """Refuse, before tokenizing, a prompt that cannot fit max_model_len whatever it tokenizes to."""
        if isinstance(prompt, str):
            size = len(prompt.encode("utf-8", "surrogatepass"))
            if size > self.max_text_bytes:
                raise OpenAIError(400, f"{param} has {size} bytes of text: more than max_model_len "
                                       f"{self.max_model_len} tokens of this model can hold", param=param)
        elif len(prompt) > self.max_model_len:
            raise OpenAIError(400, f"the {param} has {len(prompt)} tokens, more than max_model_len "
                                   f"{self.max_model_len}", param=param)

    def encode(self, text: str, add_special_tokens: bool) -> dict:
        token_ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        return {"prompt": text, "prompt_token_ids": token_ids}

    def from_ids(self, token_ids: list[int]) -> dict:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise OpenAIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return {"prompt": self.tokenizer.decode(token_ids), "prompt_token_ids": list(token_ids)}

    def chat_prompt(self, messages: list[ChatMessage], fields: ChatTemplateFields,
                    add_special_tokens: bool = False) -> dict:
        """Render the conversation with the chat template (the server's override, else the model's)."""
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model has no chat template: use /v1/completions, or start the server "
                                   "with --chat-template FILE", param="messages")
        conversation = [_template_message(m, i) for i, m in enumerate(messages)]
        self.check_length("".join(m["content"] or "" for m in conversation if isinstance(m["content"], str)),
                          "messages")
        try:
            return render_chat(self.tokenizer, conversation, self.chat_template, fields.add_generation_prompt,
                               add_special_tokens, continue_final_message=fields.continue_final_message,
                               **(fields.chat_template_kwargs or {}))
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise OpenAIError(400, f"the chat template could not render these messages: {exc}",
                              param="messages") from exc

    def max_tokens(self, prompt: dict, requested: int | None, param: str) -> int | None:
        """Refuse, as vLLM does, a request whose prompt plus max_tokens exceed max_model_len.

        A prompt longer than max_model_len on its own is left to the engine, whose error names both lengths.
        """
        num_prompt = len(prompt["prompt_token_ids"])
        if requested is None or num_prompt > self.max_model_len or num_prompt + requested <= self.max_model_len:
            return requested
        raise OpenAIError(400, f"{param} {requested} is too large: the prompt has {num_prompt} tokens and "
                               f"max_model_len is {self.max_model_len}, so at most {self.max_model_len - num_prompt} "
                               f"tokens can be generated; lower {param}", param=param)


def _template_message(message: ChatMessage, index: int) -> dict:
    """A message as chat templates expect it: text parts joined into one string."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(400, f"messages[{index}]: content parts of type {part.type!r} are not supported; "
                                       f"send text", param="messages")
            texts.append(part.text)
        content = "\n".join(texts)
    return {**(message.model_extra or {}), "role": message.role, "content": content}
