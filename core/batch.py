"""The one thing a backend receives per step: all scheduled tokens of all sequences, flattened. Part of the
backend contract, so it imports nothing of the core but ``pagedllm.utils`` (``sched.batch_builder`` makes it from
the scheduler's output)."""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedllm.utils import cdiv


@dataclasses.dataclass
class Batch:
    """Backend-agnostic step input. Sequences with one query token (decodes) come first.

    Sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]`` of ``input_ids``; it has
    ``num_computed[i]`` tokens in the KV cache before the step and ``seq_lens[i]`` after it; its blocks
    are ``block_table[i, :ceil(seq_lens[i] / block_size)]`` (the rest of the row is padding, 0).
    ``slot_mapping[t]`` is where token ``t``'s K/V go (block * block_size + offset). Logits are wanted
    only for the rows ``logits_indices``, in ascending order: the last token of every sequence that samples, and
    the prompt positions of a request that asked for its prompt's logprobs.
    """

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B + 1]
    num_computed: np.ndarray  # int32 [B]
    seq_lens: np.ndarray  # int32 [B]
    block_table: np.ndarray  # int32 [B, max blocks of any sequence in the step]
    slot_mapping: np.ndarray  # int64 [T]
    logits_indices: np.ndarray  # int64 [S]
    num_decodes: int
    block_size: int
    lora_ids: np.ndarray | None = None  # int32 [B]: each sequence's adapter (0: none); None when no sequence has one

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.num_seqs else 0

    def num_blocks_per_seq(self) -> np.ndarray:
        return cdiv(self.seq_lens, self.block_size)


@dataclasses.dataclass
class EncodeBatch:
    """A pooling step's input: whole prompts, flattened; sequence ``i`` owns tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` of ``input_ids`` (positions from 0). Nothing is cached."""

    input_ids: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B + 1]

    @property
    def num_seqs(self) -> int:
        return len(self.query_start_loc) - 1
