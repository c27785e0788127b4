"""One Batch -> the paged model's inputs, after checking every block table.

The CPU plugin does no bounds checking: a block id past the cache is a silent out-of-bounds write, and
a table too short for the context is a segfault. So a bad table is refused here, before ``infer``.
"""

from __future__ import annotations

import numpy as np

from pagedllm.backends.openvino.logits_gather import SAMPLED_INDICES
from pagedllm.batch import Batch


class InvalidBlockTableError(ValueError):
    """A batch whose block tables would make the plugin read or write outside the KV cache."""


def paged_inputs(batch: Batch, num_blocks: int, block_size: int) -> dict[str, np.ndarray]:
    """Raises InvalidBlockTableError if the batch cannot run safely."""
    _check_layout(batch, block_size)
    blocks_per_seq = batch.num_blocks_per_seq()
    table = batch.block_table
    short = np.flatnonzero(blocks_per_seq > table.shape[1])
    if short.size:
        i = int(short[0])
        raise InvalidBlockTableError(
            f"sequence {i} has {batch.seq_lens[i]} tokens of context, which need {blocks_per_seq[i]} blocks of "
            f"{block_size}, but its block table has only {table.shape[1]}")
    used = np.arange(table.shape[1]) < blocks_per_seq[:, None]
    block_indices = np.ascontiguousarray(table[used], dtype=np.int32)  # per sequence, in logical order
    bad = np.flatnonzero((block_indices < 0) | (block_indices >= num_blocks))
    if bad.size:
        seq = int(np.searchsorted(np.cumsum(blocks_per_seq), bad[0], side="right"))
        raise InvalidBlockTableError(
            f"sequence {seq} refers to KV block {block_indices[bad[0]]}, but the cache has blocks 0..{num_blocks - 1}")
    begins = np.zeros(batch.num_seqs + 1, dtype=np.int32)
    np.cumsum(blocks_per_seq, out=begins[1:])
    return {
        "input_ids": np.ascontiguousarray(batch.input_ids, dtype=np.int64),
        "position_ids": np.ascontiguousarray(batch.positions, dtype=np.int64),
        "past_lens": np.ascontiguousarray(batch.num_computed, dtype=np.int32),
        "subsequence_begins": np.ascontiguousarray(batch.query_start_loc, dtype=np.int32),
        "block_indices": block_indices,
        "block_indices_begins": begins,
        "max_context_len": np.array(batch.max_seq_len, dtype=np.int32),
        SAMPLED_INDICES: np.ascontiguousarray(batch.logits_indices, dtype=np.int64),
    }


def _check_layout(batch: Batch, block_size: int) -> None:
    """The per-sequence offsets and lengths the kernel trusts."""
    if batch.block_size != block_size:
        raise InvalidBlockTableError(f"the batch uses blocks of {batch.block_size} tokens, the cache {block_size}")
    qsl = batch.query_start_loc
    if (len(qsl) != batch.num_seqs + 1 or qsl[0] != 0 or qsl[-1] != batch.num_tokens
            or np.any(np.diff(qsl) < 1) or len(batch.positions) != batch.num_tokens):
        raise InvalidBlockTableError("query_start_loc does not split the batch's tokens into its sequences")
    if np.any(batch.num_computed < 0) or np.any(batch.seq_lens != batch.num_computed + np.diff(qsl)):
        raise InvalidBlockTableError("seq_lens must equal num_computed plus each sequence's new tokens")
    if batch.logits_indices.size and (batch.logits_indices.min() < 0
                                      or batch.logits_indices.max() >= batch.num_tokens):
        raise InvalidBlockTableError(f"logits_indices must lie in [0, {batch.num_tokens})")
