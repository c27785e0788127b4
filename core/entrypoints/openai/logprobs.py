"""Logprobs in OpenAI's two shapes and vLLM's ``prompt_logprobs``, from the engine's per-token ``{token id: Logprob}``
(the token there, then the top alternatives)."""

from __future__ import annotations

import math
from typing import Callable

from pagedllm.outputs import PositionLogprobs

# JSON has no -inf; like vLLM, report an impossible token with a very low finite logprob.
_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def completion_logprobs(token_ids: list[int], entries: list[PositionLogprobs | None],
                        token_text: Callable[[int], str], text_offset: int = 0) -> tuple[dict, int]:
    """The completions shape (tokens, token_logprobs, top_logprobs, text_offset) and the offset after it. An entry
    of None (the first prompt token, with echo) has no logprob: null, as OpenAI's."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else _finite(entry[token_id].logprob))
        top_logprobs.append(None if entry is None else {token_text(t): _finite(lp.logprob) for t, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, text_offset)


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], token_text: Callable[[int], str],
                  top_k: int) -> list[dict]:
    """The chat shape: per token {token, logprob, bytes, top_logprobs} with the top ``top_k`` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)
        if len(ranked) > top_k:  # the sampled token was not among the top k: it is not an alternative
            ranked = [item for item in ranked if item[0] != token_id]
        content.append({**_chat_token(token_text(token_id), entry[token_id].logprob),
                        "top_logprobs": [_chat_token(token_text(t), lp.logprob) for t, lp in ranked[:top_k]]})
    return content


def vllm_prompt_logprobs(entries: list[PositionLogprobs | None] | None,
                         token_text: Callable[[int], str]) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` response field: per prompt token {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": token_text(t)}
             for t, lp in entry.items()} for entry in entries]


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
