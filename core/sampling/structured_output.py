"""Structured outputs: a request's output held to a JSON schema, a regex, a list of choices or a grammar (xgrammar).

- ``StructuredOutputsParams`` (in ``pagedllm.sampling_params``) says what to follow (vLLM's class of that name).
- ``StructuredOutputManager`` (one per engine) compiles each distinct constraint once, with the engine's tokenizer,
  and gives every sequence that follows it a ``GrammarState`` of its own (an xgrammar matcher).
- ``apply_bitmasks`` runs in the sampler, before any other logits processing: the rows whose request has a grammar
  get its next-token bitmask (illegal tokens to -inf); a batch without such rows costs one scan of the requests.
- The engine calls ``GrammarState.accept`` with each sampled token and ends the request when it returns False (the
  grammar is finished, or, which the mask rules out, the token broke it).

Preemption recomputes the KV cache of a request but keeps its output tokens, so the matcher, which has seen exactly
those tokens, needs nothing. xgrammar is imported on first use: an engine that never sees a constraint never loads it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re

import torch

from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import STRUCTURED_OUTPUTS_PARAM, StructuredOutputsParams

logger = logging.getLogger("pagedllm.sampling.structured_output")

# xgrammar prefixes its errors with "[time] /path/file.cc:line: "; the rest names the problem.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarState:
    """One sequence's place in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the sequence must end here (grammar finished or broken)."""
        matcher = self.matcher
        if not matcher.accept_token(token_id):
            logger.warning("token %d does not continue the grammar (every allowed token was excluded by other "
                           "sampling settings); the sequence ends here", token_id)
            return False
        return not matcher.is_terminated()

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest start of ``tokens`` the grammar accepts from here (a copy of the matcher walks it)."""
        matcher = self.matcher.fork()
        for i, token in enumerate(tokens):
            if matcher.is_terminated() or not matcher.accept_token(token):
                return tokens[:i]
        return tokens

    def masks_along(self, tokens: list[int], vocab_size: int) -> torch.Tensor:
        """The token bitmasks at each step of following ``tokens`` (which it must accept) and after them: one row
        per position, for verifying proposals."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(tokens) + 1, vocab_size)  # all allowed: rows past the grammar's
        matcher = self.matcher.fork()  # end are never used (the sequence ends there)
        for i in range(len(tokens) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, i)
            if i < len(tokens):
                matcher.accept_token(tokens[i])
        return bitmask


class StructuredOutputManager:
    """Compiles constraints on a thread of its own (xgrammar lets go of the GIL meanwhile, so steps go on), once
    per distinct one (least recently used dropped past ``cache_size``), and makes matchers for them."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_size: int = 256,
                 compile_timeout: float = 5.0, max_bytes: int = 65536) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.compile_timeout = compile_timeout
        self.max_bytes = max_bytes
        self.num_compiled = 0
        self._compiled: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = \
            collections.OrderedDict()
        self._compiler = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def check_size(self, params: StructuredOutputsParams) -> None:
        """Refuse a constraint too large to compile in good time (a schema, or thousands of choices)."""
        size = len(params.key()[1].encode("utf-8"))
        if size > self.max_bytes:
            raise InvalidRequestError(f"the {params.kind} constraint has {size} bytes, more than the "
                                      f"{self.max_bytes} allowed (--structured-outputs-max-bytes)",
                                      param=STRUCTURED_OUTPUTS_PARAM)

    def compile_async(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of ``params``, as a future (an already compiled one is done at once)."""
        key = params.key()
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        future = self._pool.submit(self._compile, *key)
        self.num_compiled += 1
        self._compiled[key] = future
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return future

    def compiled(self, future: concurrent.futures.Future, timeout: float | None = None):
        """The grammar, or ``InvalidRequestError`` for a constraint that does not compile, or does not within the
        compile timeout (waited for here when ``timeout`` is given, else the future must be done)."""
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise self.timeout_error() from None

    def timeout_error(self) -> InvalidRequestError:
        return InvalidRequestError(f"the constraint did not compile within {self.compile_timeout:g} s "
                                   f"(--structured-outputs-compile-timeout); simplify it",
                                   param=STRUCTURED_OUTPUTS_PARAM)

    def new_state(self, params: StructuredOutputsParams, stop_ids: frozenset[int]) -> GrammarState:
        """A fresh matcher for a sequence, compiling (and waiting up to the compile timeout) if need be; raises
        ``InvalidRequestError`` naming the problem when the constraint does not compile."""
        self.check_size(params)
        return self.state_for(self.compiled(self.compile_async(params), self.compile_timeout), stop_ids)

    @staticmethod
    def state_for(compiled, stop_ids: frozenset[int]) -> GrammarState:
        """A matcher of a compiled grammar; ``stop_ids`` (the sequence's EOS and stop token ids) end it."""
        import xgrammar as xgr

        if stop_ids:
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))
        else:  # ignore_eos without stop tokens: the sequence ends where the grammar does
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return GrammarState(matcher)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, value: str):
        compiler = self._get_compiler()
        what = {"json": "the JSON schema", "regex": "the regex", "grammar": "the grammar", "choice": "the choices",
                "json_object": "json_object"}[kind]
        try:
            if kind == "json":
                # Compact JSON (", " and ": " between items, no free whitespace): a small model left free to
                # add whitespace may emit nothing else until max_tokens.
                return compiler.compile_json_schema(value, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                choices = json.loads(value)
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
            if "::=" in value:
                return compiler.compile_grammar(value)
            return compiler.compile_lark(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            detail = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()
            raise InvalidRequestError(f"{what} is invalid: {detail}", param=STRUCTURED_OUTPUTS_PARAM) from None

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def apply_bitmasks(logits: torch.Tensor, requests) -> None:
    """Mask, in place, the tokens that the grammar of each constrained row does not allow next."""
    rows = [i for i, request in enumerate(requests) if request.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = torch.empty(len(requests), (logits.shape[-1] + 31) // 32, dtype=torch.int32)
    for i in rows:
        requests[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
