"""Incremental detokenization: each new token yields the text it adds, never a broken character.

Decoding only a short window (a few tokens of context before the new ones) keeps the cost per token
constant; the context keeps leading spaces right, and a trailing U+FFFD (an incomplete UTF-8
sequence) holds the text back until the character is complete (or the sequence ends). Stop strings are matched here too.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        # While streaming, hold back text that could still turn out to be the start of a stop string.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0
        self._sent = 0

    def add_token(self, token_id: int) -> str | None:
        """Append a token; returns the stop string it completed, if any (the text is cut there)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        new_text = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += new_text
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> str | None:
        found = None  # (start, stop) of the earliest match
        for stop in self.stop:
            start = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if start != -1 and (found is None or start < found[0]):
                found = (start, stop)
        if found is None:
            return None
        start, stop = found
        self.text = self.text[:start + len(stop)] if self.include_stop else self.text[:start]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet (all of it once finished: then also an incomplete character held back, as
        U+FFFD, so that the text equals the tokenizer's decode of all the tokens)."""
        if finished and self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self.text += self._decode(self._ids[self._prefix_offset:])[len(prefix):]
            self._prefix_offset = self._read_offset = len(self._ids)
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._holdback)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta


def _decoder(tokenizer, skip_special_tokens: bool):
    """ids -> text. For a fast tokenizer that does no clean-up of spaces, the tokenizers library's own decode:
    transformers' wrapper around it gives the same text at several times the cost."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
