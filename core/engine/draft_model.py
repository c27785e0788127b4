"""Speculative decoding's draft model: a smaller model of the same tokenizer proposes each speculating request's
next k tokens greedily, k forward passes of its own before the target verifies them in one.

The draft runs on a second instance of the target's backend, with a KV cache of its own laid out on the same
block ids: a token's draft keys and values sit in the slot where the target keeps its own. So the target's block
allocator, prefix cache, preemption and forks need to know nothing of the draft. The draft computes its cache
lazily, only for requests that speculate: ``Request.num_draft_computed`` counts the positions whose draft KV is
right, the first proposal of a request catches up over its whole sequence, and a rejected proposal's draft KV is
simply overwritten later. What the draft keeps in a block never changes the target's output, only how many
proposals are right.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from pagedllm.backend import Backend, ModelInfo
from pagedllm.batch import Batch
from pagedllm.config import EngineConfig
from pagedllm.errors import ConfigError
from pagedllm.models.source import ModelSource, load_tokenizer, resolve_model
from pagedllm.request import Request
from pagedllm.sched.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.sched.speculation import SpeculativeConfig
from pagedllm.utils import cdiv

logger = logging.getLogger("pagedllm.engine.draft_model")


def draft_config(config: EngineConfig, spec: SpeculativeConfig) -> EngineConfig:
    """The target's settings for the draft's backend, with the draft's model and quantization, alone (no tensor
    parallelism, no speculation and no LoRA adapters of its own)."""
    options = dict(config.backend_options)
    if options.get("tensor_parallel_size", 1) > 1 or options.get("nnodes", 1) > 1:
        raise ConfigError("--speculative-config: a draft model does not run with tensor parallelism yet; use the "
                          "n-gram method, or one rank")
    if "quantization" in options:
        options["quantization"] = spec.quantization or "auto"
    return dataclasses.replace(config, model=spec.model, revision=None, tokenizer=None, speculative_config=None,
                               enable_lora=False, backend_options=options, sources=dict(config.sources))


def check_same_vocabulary(target_tokenizer, draft_source: ModelSource) -> None:
    """Proposals are token ids: the draft must spell every token as the target does."""
    draft_tokenizer = load_tokenizer(draft_source)
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ConfigError(f"--speculative-config: the draft model {draft_source.name} has another tokenizer than the "
                          f"target; a draft model must share the target's vocabulary")


@dataclasses.dataclass
class _Drafting:
    """One request's proposals in progress."""

    item: ScheduledRequest
    limit: int  # how many tokens to propose
    tokens: list[int] = dataclasses.field(default_factory=list)

    @property
    def request(self) -> Request:
        return self.item.request


class DraftModel:
    def __init__(self, backend: Backend, info: ModelInfo, spec: SpeculativeConfig, target_vocab_size: int,
                 max_num_batched_tokens: int, block_size: int) -> None:
        self.backend = backend
        self.info = info
        self.spec = spec
        self.vocab_size = min(target_vocab_size, info.vocab_size)  # a draft id past the target's is never right
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size

    @classmethod
    def load(cls, backend_cls: type[Backend], config: EngineConfig, spec: SpeculativeConfig, target_tokenizer,
             target_vocab_size: int) -> "DraftModel":
        """Load the draft's weights (its KV cache comes later, with the target's block count)."""
        dconfig = draft_config(config, spec)
        source = resolve_model(spec.model, None, config.download_dir, None, config.trust_remote_code)
        check_same_vocabulary(target_tokenizer, source)
        backend = backend_cls(dconfig, source)
        try:
            info = backend.load_model()
            backend.check_block_size(config.block_size)
        except BaseException:
            backend.shutdown()
            raise
        logger.info("draft model %s (%s, %d layers): %s", source.name, info.architecture, info.num_layers,
                    backend.describe() or "-")
        return cls(backend, info, spec, target_vocab_size, config.max_num_batched_tokens, config.block_size)

    def propose(self, output: SchedulerOutput) -> None:
        """Fill the proposals of the step's speculating requests (the scheduler reserved their slots): up to the
        reserved count each, cut where the draft's context would pass its own limit or where a grammar refuses."""
        drafting = []
        for item in output.scheduled:
            if not item.spec_tokens:
                continue
            request = item.request
            limit = min(len(item.spec_tokens), self.info.max_model_len - request.num_tokens)
            if limit <= 0:
                self._set(item, [])
                continue
            drafting.append(_Drafting(item, limit))
        if not drafting:
            return
        with torch.inference_mode():
            self._catch_up(drafting)
            for step in range(1, max(d.limit for d in drafting)):
                more = [d for d in drafting if len(d.tokens) < d.limit]
                self._decode(more, step)
        for d in drafting:
            request = d.request
            # the draft's KV is right up to its last proposal's position, if the target accepts them all
            request.num_draft_computed = request.num_tokens + d.limit - 1
            tokens = d.tokens
            if request.grammar is not None:
                tokens = request.grammar.allowed_prefix(tokens)
            self._set(d.item, tokens)

    @staticmethod
    def _set(item: ScheduledRequest, tokens: list[int]) -> None:
        # fewer than reserved: the blocks stay the request's, the spare budget goes unused this step
        item.num_new_tokens = 1 + len(tokens)
        item.spec_tokens = tokens

    def _catch_up(self, drafting: list[_Drafting]) -> None:
        """The first proposal of each request: its tokens the draft has not seen yet (one or two in a steady
        decode, the whole sequence the first time), in passes of at most max_num_batched_tokens."""
        # a proposal the target rejected (or never verified) left wrong draft KV past the target's computed tokens
        pending = {id(d): min(d.request.num_draft_computed, d.request.num_computed_tokens) for d in drafting}
        while pending:
            budget = self.max_num_batched_tokens
            seqs, finishing = [], []
            for d in drafting:
                start = pending.get(id(d))
                if start is None or budget <= 0:
                    continue
                end = min(d.request.num_tokens, start + budget)
                seqs.append((d.request.all_token_ids[start:end], start, d.request.block_ids))
                budget -= end - start
                if end == d.request.num_tokens:
                    finishing.append(len(seqs) - 1)
                    del pending[id(d)]
                else:
                    pending[id(d)] = end
            logits = self._run(seqs, finishing)
            done = [d for d in drafting if id(d) not in pending and not d.tokens]
            for d, token in zip(done, self._argmax(logits)):
                d.tokens.append(token)

    def _decode(self, drafting: list[_Drafting], step: int) -> None:
        """Proposal ``step + 1`` of each request, from proposal ``step`` at the position after the last one."""
        seqs = [([d.tokens[-1]], d.request.num_tokens - 1 + step, d.request.block_ids) for d in drafting]
        for d, token in zip(drafting, self._argmax(self._run(seqs, list(range(len(seqs)))))):
            d.tokens.append(token)

    def _argmax(self, logits) -> list[int]:
        return torch.as_tensor(logits)[:, :self.vocab_size].argmax(dim=-1).tolist()

    def _run(self, seqs: list[tuple[list[int], int, list[int]]], logits_of: list[int]):
        """One forward pass of the draft over ``seqs`` (tokens, first position, block ids); logits of the last
        token of the sequences ``logits_of``, in that order."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) != 1)  # one-token sequences first
        wanted = set(logits_of)
        bs = self.block_size
        q_lens = np.array([len(seqs[i][0]) for i in order], dtype=np.int32)
        num_computed = np.array([seqs[i][1] for i in order], dtype=np.int32)
        seq_lens = num_computed + q_lens
        table = np.zeros((len(order), cdiv(int(seq_lens.max()), bs)), dtype=np.int32)
        for row, i in enumerate(order):
            blocks = seqs[i][2][:cdiv(int(seq_lens[row]), bs)]
            table[row, :len(blocks)] = blocks
        query_start_loc = np.zeros(len(order) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        positions = np.concatenate([np.arange(c, c + q, dtype=np.int64) for c, q in zip(num_computed, q_lens)])
        seq_index = np.repeat(np.arange(len(order)), q_lens)
        slot_mapping = table[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        rows = [row for row, i in enumerate(order) if i in wanted]  # batch order
        batch = Batch(
            input_ids=np.asarray([t for i in order for t in seqs[i][0]], dtype=np.int64), positions=positions,
            query_start_loc=query_start_loc, num_computed=num_computed, seq_lens=seq_lens, block_table=table,
            slot_mapping=slot_mapping, logits_indices=query_start_loc[1:][rows].astype(np.int64) - 1,
            num_decodes=int(np.count_nonzero(q_lens == 1)), block_size=bs)
        logits = torch.as_tensor(self.backend.execute(batch))
        # back from batch order to the order of ``logits_of``
        row_of = {order[row]: j for j, row in enumerate(rows)}
        return logits[[row_of[i] for i in logits_of]]
