"""Paged attention for transformers' model classes, registered as an attention implementation.

transformers calls ``paged_attention(module, query, key, value, ...)`` in every layer with all tokens of the
step packed into one row. The new keys and values go into the layer's block cache first, then we attend with the
C++ kernels, which read the blocks in place: decodes (one query token each) in one call, which also stores their
new rows and reads the blocks all of them begin with (a shared prompt prefix) once per 16 sequences; prompt chunks
in another (no gather of a cached prefix, no padding of short chunks to long ones).
Without the kernels, pure torch: a gather of the blocks plus SDPA, prompt chunks padded to the longest chunk of
their bucket (chunks are bucketed by length so that a 544-token prompt does not pad thirty 32-token ones).
Query heads that share a KV head are folded into rows, so no head repeat is materialized.
Under batch invariance every token, of a prompt chunk or a decode, is a row of the decode kernel, which attends to
its own context length: a token's sums then run in one order whether it came alone, in a chunk, or beside others."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.backends.cpu.layers import kv_cache
from pagedllm.batch import Batch
from pagedllm.utils import cdiv

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
        self.num_blocks = cdiv(int((self.past + self.q_lens).max()), block_size)
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

    def __init__(self, batch: Batch, kv_caches: list[tuple], kernels=None, batch_invariant: bool = False) -> None:
        self.kv_caches = kv_caches
        self.kernels = kernels  # the C++ decode kernel module, or None for the pure torch path
        block_size = self.block_size = batch.block_size
        self.slots = torch.from_numpy(batch.slot_mapping)
        self._slot_rows: torch.Tensor | None = None
        self._masks: dict[int | None, torch.Tensor | None] = {}
        self.per_token = batch_invariant and kernels is not None
        if self.per_token:
            self._per_token_rows(batch)
            return

        num_decodes = batch.num_decodes
        self.num_decodes = num_decodes
        seq_lens = torch.from_numpy(batch.seq_lens).long()
        table = torch.from_numpy(batch.block_table).long()
        if num_decodes:
            self.decode_lens = seq_lens[:num_decodes]
            self.decode_num_blocks = cdiv(int(self.decode_lens.max()), block_size)
            self.decode_table = table[:num_decodes, :self.decode_num_blocks].contiguous()
            self.decode_blocks = self.decode_table.reshape(-1)
            self.decode_slots = self.slots[:num_decodes]
            self.decode_shared_blocks = (shared_prefix_blocks(self.decode_table, self.decode_lens, block_size)
                                         if kernels is not None else 0)

        self.prefill_groups: list[PrefillGroup] = []
        self.num_prefills = batch.num_seqs - num_decodes
        if self.num_prefills:
            q_start = torch.from_numpy(batch.query_start_loc).long()
            q_lens = q_start[1:] - q_start[:-1]
            past = torch.from_numpy(batch.num_computed).long()
            if kernels is not None:  # one kernel call reads the chunks' blocks in place
                self.prefill_starts = q_start[num_decodes:-1]
                self.prefill_lens, self.prefill_past = q_lens[num_decodes:], past[num_decodes:]
                width = cdiv(int(seq_lens[num_decodes:].max()), block_size)
                self.prefill_table = table[num_decodes:, :width].contiguous()
            else:
                for bucket in _length_buckets(q_lens[num_decodes:].tolist()):
                    members = torch.tensor(bucket, dtype=torch.long) + num_decodes
                    self.prefill_groups.append(PrefillGroup(members, q_start, q_lens, past, table, block_size))

    def _per_token_rows(self, batch: Batch) -> None:
        """Each token as a decode-kernel row: its sequence's block table and its own context length."""
        q_start = torch.from_numpy(batch.query_start_loc).long()
        q_lens = q_start[1:] - q_start[:-1]
        seq = torch.repeat_interleave(torch.arange(batch.num_seqs), q_lens)
        offset = torch.arange(int(q_start[-1])) - q_start[seq]
        self.token_lens = (torch.from_numpy(batch.num_computed).long()[seq] + offset + 1).contiguous()
        width = cdiv(int(self.token_lens.max()), self.block_size)
        self.token_table = torch.from_numpy(batch.block_table).long()[seq, :width].contiguous()
        self.num_decodes = self.num_prefills = 0

    def slot_rows(self, heads: int) -> torch.Tensor:
        """Where this step's keys and values go in every layer's cache (see kv_cache.slot_rows)."""
        if self._slot_rows is None:
            self._slot_rows = kv_cache.slot_rows(self.slots, heads, self.block_size)
        return self._slot_rows

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """[num_decodes, 1, 1, S] bool, or None when every decode attends to all gathered slots."""
        if window not in self._masks:
            span = self.decode_num_blocks * self.block_size
            keys = torch.arange(span).unsqueeze(0)
            allowed = keys < self.decode_lens.unsqueeze(1)
            if window is not None:
                allowed &= keys > (self.decode_lens.unsqueeze(1) - 1 - window)
            self._masks[window] = None if bool(allowed.all()) else allowed[:, None, None, :]
        return self._masks[window]


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] (after RoPE) -> ([1, T, Hq, D], None)."""
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 scaling, kwargs.get("sliding_window"), kwargs["paged_metadata"])
    return out.unsqueeze(0), None


def attend(layer_idx: int, query: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
           scaling: float | None, window: int | None, metadata: PagedAttentionMetadata) -> torch.Tensor:
    """Token-major attention of one layer: query [T, Hq, D], new_keys/new_values [T, Hkv, D] (after RoPE) ->
    [T, Hq, D]. The fused decoder layers call this straight, without transformers' head-major views."""
    key_cache, value_cache = metadata.kv_caches[layer_idx]
    num_tokens, num_heads, dim = query.shape
    num_kv_heads = new_keys.shape[1]
    groups = num_heads // num_kv_heads
    dtype = query.dtype
    kernels = metadata.kernels
    num_decodes = metadata.num_decodes

    # With the C++ kernels, plain caches are written by them: the decodes' rows by the decode kernel (the block read
    # that follows pays for those cache lines once), the prompt tokens' by one pass; the rest by a torch row copy.
    kernel_writes = kernels is not None and key_cache.kernel_writes
    first = num_decodes if kernel_writes and not metadata.per_token else 0
    if first < num_tokens and kernel_writes:
        kernels.store_kv_rows(key_cache=key_cache.data, value_cache=value_cache.data, keys=new_keys[first:],
                              values=new_values[first:], slots=metadata.slots[first:])
    elif isinstance(key_cache, kv_cache.ChannelQuantizedBlockCache):
        kv_cache.write_u8(key_cache, value_cache, new_keys, new_values, metadata.slots, kernels)
    elif first < num_tokens:
        rows = metadata.slot_rows(num_kv_heads)[first * num_kv_heads:]
        key_cache.write(new_keys[first:], rows)
        value_cache.write(new_values[first:], rows)

    out = torch.empty(num_tokens, num_heads, dim, dtype=dtype)
    scale = dim ** -0.5 if scaling is None else scaling
    if kernels is not None:
        caches = kv_cache.kernel_arguments(key_cache, value_cache)
    if metadata.per_token:
        kernels.paged_decode_attention(out=out, query=query, **caches, block_table=metadata.token_table,
                                       seq_lens=metadata.token_lens, scale=scale, window=window or -1,
                                       shared_blocks=0, split_runs=False)
        return out
    if num_decodes and kernels is not None:
        new_rows = dict(new_keys=new_keys[:num_decodes], new_values=new_values[:num_decodes],
                        slots=metadata.decode_slots) if kernel_writes else {}
        kernels.paged_decode_attention(
            out=out[:num_decodes], query=query[:num_decodes], **caches, block_table=metadata.decode_table,
            seq_lens=metadata.decode_lens, scale=scale, window=window or -1,
            shared_blocks=0 if window else metadata.decode_shared_blocks, **new_rows)
    elif num_decodes:
        keys = key_cache.gather(metadata.decode_blocks, num_decodes, metadata.decode_num_blocks, dtype)
        values = value_cache.gather(metadata.decode_blocks, num_decodes, metadata.decode_num_blocks, dtype)
        decode_queries = query[:num_decodes].reshape(num_decodes, num_kv_heads, groups, dim)
        decode_out = F.scaled_dot_product_attention(decode_queries, keys, values,
                                                    attn_mask=metadata.decode_mask(window), scale=scaling)
        out[:num_decodes] = decode_out.reshape(num_decodes, num_heads, dim)
    if metadata.num_prefills and kernels is not None:
        kernels.paged_prefill_attention(
            out=out, query=query, **caches, block_table=metadata.prefill_table, past_lens=metadata.prefill_past,
            q_starts=metadata.prefill_starts, q_lens=metadata.prefill_lens, scale=scale, window=window or -1)
    for group in metadata.prefill_groups:
        num_chunks, max_q = group.size, group.max_q
        keys = key_cache.gather(group.blocks, num_chunks, group.num_blocks, dtype)
        values = value_cache.gather(group.blocks, num_chunks, group.num_blocks, dtype)
        queries = query.index_select(0, group.gather).view(num_chunks, max_q, num_kv_heads, groups, dim)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(num_chunks, num_kv_heads, groups * max_q, dim)
        mask = group.mask(window, groups, metadata.block_size)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling)
        attended = attended.view(num_chunks, num_kv_heads, groups, max_q, dim).permute(0, 3, 1, 2, 4)
        attended = attended.reshape(num_chunks * max_q, num_heads, dim)
        out[group.tokens] = attended.index_select(0, group.valid_rows)
    return out


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
