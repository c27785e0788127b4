"""Paged attention for transformers' model classes, registered as an attention implementation.

transformers calls ``paged_attention(module, query, key, value, ...)`` in every layer with all tokens of the
step packed into one row. The new keys and values go into the layer's block cache first, then we attend with the
C++ kernels, which read the blocks in place: decodes (one query token each) in one call, which also stores their
new rows and reads the blocks all of them begin with (a shared prompt prefix) once per 16 sequences; prompt chunks
in another (no gather of a cached prefix, no padding of short chunks to long ones).
Without the kernels, pure torch: a gather of the blocks plus SDPA, prompt chunks padded to the longest chunk of
their bucket (chunks are bucketed by length so that a 544-token prompt does not pad thirty 32-token ones).
Query heads that share a KV head are folded into rows, so no head repeat is materialized."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.batch import Batch
from pagedllm.backends.cpu import kv_cache

ATTENTION_NAME = "pagedllm_cpu"


# Prompt chunks padded together on the pure torch path: the longest of a group is at most this many times the
# shortest, plus a slack so that very short chunks do not each get a group of their own.
_BUCKET_RATIO, _BUCKET_SLACK = 2, 16
# A shared prefix is read once per tile of sequences only when it pays for the merge: enough sequences share
# enough tokens (in whole blocks).
_SHARED_MIN_SEQS, _SHARED_MIN_TOKENS = 4, 32


def _length_buckets(lengths: list[int]) -> list[list[int]]:
    """Indices grouped so that within a group the longest is at most _BUCKET_RATIO times the shortest (plus
    _BUCKET_SLACK): padding then costs at most ~2x, and the number of groups grows with log(longest / shortest)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] <= _BUCKET_RATIO * lengths[i] + _BUCKET_SLACK:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def shared_prefix_blocks(table: torch.Tensor, lens: torch.Tensor, block_size: int, min_seqs: int = _SHARED_MIN_SEQS,
                         min_tokens: int = _SHARED_MIN_TOKENS) -> int:
    """How many leading block-table columns hold the same block for every sequence (a prompt prefix they share
    through the prefix cache), counting only blocks each sequence filled before its newest token; 0 when fewer than
    ``min_seqs`` sequences or blocks of fewer than ``min_tokens`` tokens would share. The decode kernel then reads
    those blocks once per 16 sequences instead of once per sequence."""
    if table.shape[0] < min_seqs:
        return 0
    limit = min(table.shape[1], int((lens.min() - 1) // block_size))
    same = (table[:, :limit] == table[:1, :limit]).all(0)
    shared = limit if bool(same.all()) else int(same.int().argmin())
    return shared if shared * block_size >= min_tokens else 0


class PrefillGroup:
    """Prompt chunks attended together: their queries padded to ``max_q``, their blocks gathered."""

    def __init__(self, members: torch.Tensor, q_start: torch.Tensor, q_lens: torch.Tensor, past: torch.Tensor,
                 table: torch.Tensor, block_size: int) -> None:
        self.size = len(members)
        self.q_lens = q_lens[members]
        self.past = past[members]
        self.max_q = int(self.q_lens.max())
        self.num_blocks = -(-int((self.past + self.q_lens).max()) // block_size)
        self.blocks = table[members, :self.num_blocks].reshape(-1)
        rows = torch.arange(self.max_q)
        self.valid = rows.unsqueeze(0) < self.q_lens.unsqueeze(1)  # [size, max_q]
        # Padded query slots read the chunk's first token (any real row works); they are dropped afterwards.
        local = torch.where(self.valid, rows.unsqueeze(0), 0)
        self.gather = (q_start[members].unsqueeze(1) + local).reshape(-1)  # token index of each padded row
        self.valid_rows = self.valid.reshape(-1).nonzero().squeeze(1)
        self.tokens = self.gather[self.valid_rows]  # where each real row's output goes
        self._masks: dict[tuple, torch.Tensor] = {}

    def mask(self, window: int | None, groups: int, block_size: int) -> torch.Tensor:
        """[size, 1, groups * max_q, S] bool: query row r of a chunk sees keys up to its own position."""
        key = (window, groups)
        if key not in self._masks:
            span = self.num_blocks * block_size
            keys = torch.arange(span).view(1, 1, span)
            pos = (self.past.unsqueeze(1) + torch.arange(self.max_q).unsqueeze(0)).unsqueeze(2)
            allowed = keys <= pos
            if window is not None:
                allowed &= keys > pos - window
            # Padding rows see key 0 only, so their softmax stays finite; they are dropped anyway.
            allowed |= (~self.valid).unsqueeze(2) & (keys == 0)
            allowed = allowed.unsqueeze(1).expand(-1, groups, -1, -1).reshape(self.size, 1, -1, span)
            self._masks[key] = allowed
        return self._masks[key]


class PagedAttentionMetadata:
    """Per-step index tensors shared by all layers (built once per step from the Batch)."""

    def __init__(self, batch: Batch, kv_caches: list[tuple], kernels=None) -> None:
        self.kv_caches = kv_caches
        self.kernels = kernels  # the C++ decode kernel module, or None for the pure torch path
        bs = batch.block_size
        self.block_size = bs
        self.slots = torch.from_numpy(batch.slot_mapping)
        self._slot_rows: torch.Tensor | None = None
        self._masks: dict[int | None, torch.Tensor | None] = {}

        nd = batch.num_decodes
        self.num_decodes = nd
        seq_lens = torch.from_numpy(batch.seq_lens).long()
        table = torch.from_numpy(batch.block_table).long()
        if nd:
            self.dec_lens = seq_lens[:nd]
            self.dec_num_blocks = -(-int(self.dec_lens.max()) // bs)
            self.dec_table = table[:nd, :self.dec_num_blocks].contiguous()
            self.dec_blocks = self.dec_table.reshape(-1)
            self.dec_slots = self.slots[:nd]
            self.dec_shared = shared_prefix_blocks(self.dec_table, self.dec_lens, bs) if kernels is not None else 0

        self.prefill_groups: list[PrefillGroup] = []
        self.num_prefills = batch.num_seqs - nd
        if self.num_prefills:
            q_start = torch.from_numpy(batch.query_start_loc).long()
            q_lens = q_start[1:] - q_start[:-1]
            past = torch.from_numpy(batch.num_computed).long()
            if kernels is not None:  # one kernel call reads the chunks' blocks in place
                self.pf_starts, self.pf_lens, self.pf_past = q_start[nd:-1], q_lens[nd:], past[nd:]
                width = -(-int(seq_lens[nd:].max()) // bs)
                self.pf_table = table[nd:, :width].contiguous()
            else:
                for bucket in _length_buckets(q_lens[nd:].tolist()):
                    members = torch.tensor(bucket, dtype=torch.long) + nd
                    self.prefill_groups.append(PrefillGroup(members, q_start, q_lens, past, table, bs))

    def slot_rows(self, heads: int) -> torch.Tensor:
        """Where this step's keys and values go in every layer's cache (see kv_cache.slot_rows)."""
        if self._slot_rows is None:
            self._slot_rows = kv_cache.slot_rows(self.slots, heads, self.block_size)
        return self._slot_rows

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """[nd, 1, 1, S] bool, or None when every decode attends to all gathered slots."""
        if window not in self._masks:
            span = self.dec_num_blocks * self.block_size
            keys = torch.arange(span).unsqueeze(0)
            allowed = keys < self.dec_lens.unsqueeze(1)
            if window is not None:
                allowed &= keys > (self.dec_lens.unsqueeze(1) - 1 - window)
            self._masks[window] = None if bool(allowed.all()) else allowed[:, None, None, :]
        return self._masks[window]


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] (after RoPE) -> ([1, T, Hq, D], None)."""
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 scaling, kwargs.get("sliding_window"), kwargs["paged_metadata"])
    return out.unsqueeze(0), None


def attend(layer_idx: int, q: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor, scaling: float | None,
           window: int | None, md: PagedAttentionMetadata) -> torch.Tensor:
    """Token-major attention of one layer: q [T, Hq, D], new_keys/new_values [T, Hkv, D] (after RoPE) -> [T, Hq, D].
    The fused decoder layers call this straight, without transformers' head-major views."""
    k_cache, v_cache = md.kv_caches[layer_idx]
    num_tokens, num_heads, dim = q.shape
    num_kv_heads = new_keys.shape[1]
    groups = num_heads // num_kv_heads
    dtype = q.dtype

    nd = md.num_decodes
    # With the C++ kernels, plain caches are written by them: the decodes' rows by the decode kernel (the block read
    # that follows pays for those cache lines once), the prompt tokens' by one pass; the rest by a torch row copy.
    kernel_writes = md.kernels is not None and k_cache.kernel_writes
    first = nd if kernel_writes else 0
    if first < num_tokens and kernel_writes:
        md.kernels.store_kv_rows(key_cache=k_cache.data, value_cache=v_cache.data, keys=new_keys[first:],
                                 values=new_values[first:], slots=md.slots[first:])
    elif first < num_tokens:
        rows = md.slot_rows(num_kv_heads)[first * num_kv_heads:]
        k_cache.write(new_keys[first:], rows)
        v_cache.write(new_values[first:], rows)

    out = torch.empty(num_tokens, num_heads, dim, dtype=dtype)
    scale = dim ** -0.5 if scaling is None else scaling
    if md.kernels is not None:
        caches = kv_cache.kernel_arguments(k_cache, v_cache)
    if nd and md.kernels is not None:
        new_rows = dict(new_keys=new_keys[:nd], new_values=new_values[:nd], slots=md.dec_slots) if kernel_writes else {}
        md.kernels.paged_decode_attention(
            out=out[:nd], query=q[:nd], **caches, block_table=md.dec_table, seq_lens=md.dec_lens, scale=scale,
            window=window or -1, shared_blocks=0 if window else md.dec_shared, **new_rows)
    elif nd:
        keys = k_cache.gather(md.dec_blocks, nd, md.dec_num_blocks, dtype)
        values = v_cache.gather(md.dec_blocks, nd, md.dec_num_blocks, dtype)
        qd = q[:nd].reshape(nd, num_kv_heads, groups, dim)
        od = F.scaled_dot_product_attention(qd, keys, values, attn_mask=md.decode_mask(window), scale=scaling)
        out[:nd] = od.reshape(nd, num_heads, dim)
    if md.num_prefills and md.kernels is not None:
        md.kernels.paged_prefill_attention(
            out=out, query=q, **caches, block_table=md.pf_table, past_lens=md.pf_past, q_starts=md.pf_starts,
            q_lens=md.pf_lens, scale=scale, window=window or -1)
    for group in md.prefill_groups:
        p, max_q = group.size, group.max_q
        keys = k_cache.gather(group.blocks, p, group.num_blocks, dtype)
        values = v_cache.gather(group.blocks, p, group.num_blocks, dtype)
        qp = q.index_select(0, group.gather).view(p, max_q, num_kv_heads, groups, dim)
        qp = qp.permute(0, 2, 3, 1, 4).reshape(p, num_kv_heads, groups * max_q, dim)
        op = F.scaled_dot_product_attention(qp, keys, values, attn_mask=group.mask(window, groups, md.block_size),
                                            scale=scaling)
        op = op.view(p, num_kv_heads, groups, max_q, dim).permute(0, 3, 1, 2, 4).reshape(p * max_q, num_heads, dim)
        out[group.tokens] = op.index_select(0, group.valid_rows)
    return out


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
