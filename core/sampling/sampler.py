"""From logits of the sampled rows to one token each, for the whole batch at once.

Order per row, as in vLLM: a structured-output grammar's token mask, allowed token ids and bad words, logit bias
and min_tokens, penalties, then greedy argmax or temperature, top-k / top-p / min-p and a draw. A request with a
seed draws from its own generator, so its tokens do not depend on what else is in the batch; the others share the
engine's generator.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.request import Request
from pagedllm.sampling.structured_output import apply_bitmasks


@dataclasses.dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or (logprob of the sampled token, its rank, top token ids, their logprobs).
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """The caller's logits are left as they are (bias and penalties work on a copy), so a batch whose sampling
        raised can be sampled again request by request."""
        if logits.dtype != torch.float32:
            logits = logits.to(torch.float32)
        elif any(r.params.logit_bias or r.params.needs_penalties or r.params.allowed_token_ids or r.bad_word_ids
                 for r in requests):
            logits = logits.clone()
        want_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None

        apply_bitmasks(logits, requests)  # grammars first: what follows only reweighs the tokens they allow
        self._adjust_logits(logits, requests)
        # numpy's argmax: several times faster than torch's for a batch of rows, the same ties.
        tokens = torch.from_numpy(logits.numpy().argmax(axis=-1))
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            tokens[random_rows] = self._draw(logits[random_rows], [requests[i] for i in random_rows])
        token_list = tokens.tolist()

        logprobs: list[tuple[float, int, list[int], list[float]] | None] = [None] * len(requests)
        for j, i in enumerate(want_logprobs):
            logprobs[i] = _logprob_entry(raw_logprobs[j], token_list[i], requests[i].params.logprobs)
        return SamplerOutput(token_list, logprobs)

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, request: Request, proposals: list[int]) -> tuple[list[int], int]:
        """Speculative decoding's verification of ``proposals`` (n-gram: each a single token, a draft distribution
        of one point) from ``len(proposals) + 1`` logits rows: (the tokens to append, how many proposals were
        accepted). Greedy: a proposal stands while it is the argmax. Sampled: proposal x at row i stands with
        probability p_i(x), else the token is drawn from p_i without x (the residual max(p - q, 0) renormalized),
        and after k accepted ones a bonus token is drawn from the last row, so the output has the distribution
        plain sampling has (Leviathan et al.; vLLM's rejection sampler)."""
        logits = logits.to(torch.float32)
        if request.grammar is not None:  # each row masked as the grammar stands after the proposals before it
            import xgrammar as xgr

            logits = logits.clone() if logits.dtype == torch.float32 else logits
            xgr.apply_token_bitmask_inplace(logits, request.grammar.masks_along(proposals, logits.shape[-1]),
                                            vocab_size=logits.shape[-1])
        if request.params.greedy:
            best = logits.numpy().argmax(axis=-1).tolist()
            accepted = 0
            while accepted < len(proposals) and proposals[accepted] == best[accepted]:
                accepted += 1
            return proposals[:accepted] + [best[accepted]], accepted
        rows = [request] * len(logits)
        scaled = logits / request.params.temperature
        if request.params.needs_truncation:
            scaled = _truncate(scaled, rows)
        probs = torch.softmax(scaled, dim=-1)
        generator = request.generator or self.generator
        for i, token in enumerate(proposals):
            if torch.rand((), generator=generator) < probs[i, token]:
                continue
            residual = probs[i].clone()
            residual[token] = 0.0
            if residual.sum() <= 0:  # p is all on the proposal: it stands
                continue
            return proposals[:i] + [int(torch.multinomial(residual, 1, generator=generator))], i
        return proposals + [int(torch.multinomial(probs[-1], 1, generator=generator))], len(proposals)

    @staticmethod
    @torch.inference_mode()
    def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, int, list[int],
                                                                                       list[float]]]:
        """Row i's raw logprob and rank of ``tokens[i]`` and its top ``k``, as ``__call__`` reports them."""
        rows = torch.log_softmax(logits[:len(tokens)].to(torch.float32), dim=-1)
        return [_logprob_entry(row, token, k) for row, token in zip(rows, tokens)]

    # -- logits processing ---------------------------------------------------------------------
    @staticmethod
    def _adjust_logits(logits: torch.Tensor, requests: list[Request]) -> None:
        vocab = logits.shape[-1]
        for i, request in enumerate(requests):
            params = request.params
            if params.allowed_token_ids:
                allowed = torch.full((vocab,), float("-inf"))
                allowed[params.allowed_token_ids] = 0.0
                logits[i] += allowed
            for word in request.bad_word_ids:  # its last token, where the output so far ends with the others
                if len(word) == 1 or request.output_token_ids[-(len(word) - 1):] == word[:-1]:
                    if word[-1] < vocab:
                        logits[i, word[-1]] = float("-inf")
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias.keys()))
                logits[i, ids] += torch.tensor(list(params.logit_bias.values()))
            if request.num_output_tokens < params.min_tokens and request.stop_ids:
                logits[i, [t for t in request.stop_ids if t < vocab]] = float("-inf")
            if params.needs_penalties:
                _apply_penalties(logits[i], request, vocab)

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
        logits = logits / temps.unsqueeze(1)
        if any(r.params.needs_truncation for r in requests):
            logits = _truncate(logits, requests)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                noise[i].exponential_(generator=request.generator)
        return torch.argmax(probs / noise, dim=-1)


def _logprob_entry(row: torch.Tensor, token: int, k: int) -> tuple[float, int, list[int], list[float]]:
    """A log-softmax row's (logprob of ``token``, its rank, the top ``k`` ids, their logprobs)."""
    top_vals, top_ids = row.topk(k) if k else (row[:0], torch.zeros(0, dtype=torch.long))
    chosen = row[token]
    return float(chosen), int((row > chosen).sum()) + 1, top_ids.tolist(), top_vals.tolist()


def _apply_penalties(row: torch.Tensor, request: Request, vocab: int) -> None:
    params = request.params
    if params.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(request.all_token_ids, dtype=torch.long)] = True
        penalty = params.repetition_penalty
        row[seen] = torch.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
    if (params.frequency_penalty or params.presence_penalty) and request.output_token_ids:
        counts = torch.bincount(torch.tensor(request.output_token_ids, dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _truncate(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Top-k, then top-p, then min-p, each per row; truncated entries become -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)
    top_k = torch.tensor([min(r.params.top_k, vocab) or vocab for r in requests]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([r.params.top_p for r in requests], dtype=probs.dtype).unsqueeze(1)
    cumulative = probs.cumsum(dim=-1)
    drop = (cumulative - probs) > top_p  # keep the smallest prefix whose mass reaches top_p
    min_p = torch.tensor([r.params.min_p for r in requests], dtype=probs.dtype).unsqueeze(1)
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
