"""Turns the scheduler's output into the backend's ``Batch``.

Each running request's block table lives in a persistent numpy row; only the blocks added since the request's
last step are copied in, so building a batch costs O(sequences + scheduled tokens), not O(context).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedllm.batch import Batch
from pagedllm.request import Request
from pagedllm.sched.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.utils import cdiv


@dataclasses.dataclass
class PromptLogprobRows:
    """Logits rows ``first_row:first_row + count`` predict prompt tokens ``first_token:first_token + count`` of
    ``request`` (the token after each row's position)."""

    request: Request
    first_row: int
    count: int
    first_token: int


@dataclasses.dataclass
class ProposalRows:
    """Logits rows ``first_row:first_row + len(item.spec_tokens) + 1``: the request's last token's and each proposed
    token's, to verify the proposals with."""

    item: ScheduledRequest
    first_row: int


@dataclasses.dataclass
class LogitsRows:
    """Where each wanted logits row came from: ``sample_rows[j]`` is the row of ``sampling[j]``'s last token;
    ``prompt`` lists the rows of prompt positions whose logprobs were asked for (none in most steps)."""

    sampling: list[int]  # positions in batch order of the sequences that sample a token this step
    sample_rows: list[int]
    prompt: list[PromptLogprobRows]
    proposals: list[ProposalRows] = dataclasses.field(default_factory=list)


class BatchBuilder:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        max_blocks = cdiv(max_model_len, block_size)
        self._table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._row_of: dict[str, int] = {}
        self._row_len: dict[str, int] = {}

    @property
    def rows_in_use(self) -> int:
        return len(self._row_of)

    def release(self, request_ids: list[str]) -> None:
        """Free the rows of requests whose blocks were freed (finished, aborted or preempted)."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)
                del self._row_len[request_id]

    def build(self, output: SchedulerOutput) -> tuple[Batch, list[ScheduledRequest], LogitsRows]:
        """Returns the batch, the scheduled requests in batch order, and what each logits row is for. Rows of
        ``output.released_ids`` must be released first."""
        order = [s for s in output.scheduled if s.num_new_tokens == 1]
        order += [s for s in output.scheduled if s.num_new_tokens != 1]
        num_seqs = len(order)

        rows = np.empty(num_seqs, dtype=np.int64)
        q_lens = np.empty(num_seqs, dtype=np.int32)
        num_computed = np.empty(num_seqs, dtype=np.int32)
        input_ids: list[int] = []
        sampling: list[int] = []
        logits_indices: list[int] = []
        rows_for = LogitsRows(sampling, [], [])
        num_tokens = 0
        for i, item in enumerate(order):
            request = item.request
            rid = request.request_id
            row = self._row_of.get(rid)
            if row is None:
                row = self._free_rows.pop()
                self._row_of[rid] = row
                self._row_len[rid] = 0
            synced = self._row_len[rid]
            if synced < len(request.block_ids):  # only the blocks added since the last step
                self._table[row, synced:len(request.block_ids)] = request.block_ids[synced:]
                self._row_len[rid] = len(request.block_ids)
            rows[i] = row
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            q_lens[i] = item.num_new_tokens
            num_computed[i] = start
            if item.num_new_tokens == 1:
                input_ids.append(request.all_token_ids[start])
            elif item.spec_tokens:
                input_ids.append(request.all_token_ids[start])
                input_ids.extend(item.spec_tokens)
            else:
                input_ids.extend(request.all_token_ids[start:end])
            if request.needs_prompt_logprobs:  # the rows whose next token is a prompt token not yet scored
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(end, request.num_prompt_tokens - 1)
                if last > first:
                    rows_for.prompt.append(PromptLogprobRows(request, len(logits_indices), last - first, first + 1))
                    logits_indices.extend(range(num_tokens + first - start, num_tokens + last - start))
            num_tokens += item.num_new_tokens
            if item.spec_tokens:  # verified from a row per position, sampled by the engine, not the sampler
                rows_for.proposals.append(ProposalRows(item, len(logits_indices)))
                logits_indices.extend(range(num_tokens - item.num_new_tokens, num_tokens))
            elif end == request.num_tokens:
                sampling.append(i)
                rows_for.sample_rows.append(len(logits_indices))
                logits_indices.append(num_tokens - 1)

        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = num_computed + q_lens
        bs = self.block_size
        max_blocks = cdiv(int(seq_lens.max()), bs) if num_seqs else 0
        block_table = self._table[rows, :max_blocks]

        seq_index = np.repeat(np.arange(num_seqs), q_lens)
        positions = (np.arange(num_tokens, dtype=np.int64)
                     + np.repeat(num_computed.astype(np.int64) - query_start_loc[:-1], q_lens))
        slot_mapping = block_table[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        batch = Batch(
            input_ids=np.asarray(input_ids, dtype=np.int64),
            positions=positions,
            query_start_loc=query_start_loc,
            num_computed=num_computed,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
            num_decodes=int(np.count_nonzero(q_lens == 1)),
            block_size=bs,
            lora_ids=(np.fromiter((item.request.lora_id for item in order), dtype=np.int32, count=num_seqs)
                      if any(item.request.lora_id for item in order) else None),
        )
        return batch, order, rows_for
