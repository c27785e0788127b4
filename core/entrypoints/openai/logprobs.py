"""Logprobs in OpenAI's two shapes, from the engine's per-token ``{token id: logprob}`` (sampled token + top k)."""

from __future__ import annotations

import math
from typing import Callable

# JSON has no -inf; like vLLM, report an impossible token with a very low finite logprob.
_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], token_text: Callable[[int], str],
                        text_offset: int = 0) -> tuple[dict, int]:
    """The completions shape (tokens, token_logprobs, top_logprobs, text_offset) and the offset after it."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry[token_id]))
        top_logprobs.append({token_text(t): _finite(lp) for t, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, text_offset)


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], token_text: Callable[[int], str],
                  top_k: int) -> list[dict]:
    """The chat shape: per token {token, logprob, bytes, top_logprobs} with the top ``top_k`` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda item: -item[1])
        if len(ranked) > top_k:  # the sampled token was not among the top k: it is not an alternative
            ranked = [item for item in ranked if item[0] != token_id]
        content.append({**_chat_token(token_text(token_id), entry[token_id]),
                        "top_logprobs": [_chat_token(token_text(t), lp) for t, lp in ranked[:top_k]]})
    return content


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
