"""Per-layer block caches for keys and values: plain (fp32/bf16) or u8 (vLLM's CPU backend has no u8 cache; it holds
~1.9x the tokens of bf16 per GiB at head size 64). u8 values have a scale and minimum per token and head; u8 keys
per block, head and channel, as OpenVINO's CPU plugin keeps them (a few key channels carry most of the magnitude;
see csrc/store_kv_u8.cpp, and ``write_u8`` here for the same in torch).

Layout [num_blocks, kv_heads, block_size, head_size], as IPEX's and OpenVINO's paged caches; u8 keys are
[num_blocks, kv_heads, head_size, block_size] (channel-major in a block: the kernels score a channel of consecutive
tokens per vector load, with the channel's scale folded into the query).
"""

from __future__ import annotations

import math
import mmap

import torch

from pagedllm.backends.common.memory import commit


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from an anonymous mapping: the kernel hands out zero pages on first touch, so a large cache costs
    no resident memory until blocks are used (beyond the first ones, which commit_first_blocks backs at start-up).
    Transparent huge pages are asked for: in a VM a fault per 4 KiB page makes first writes far dearer."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: 4 KiB pages, still lazy
            pass
    # The tensor holds a reference to the mapping, which is unmapped when the last view goes away.
    return torch.frombuffer(region, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


class BlockCache:
    """One layer's keys or values in the given dtype."""

    kernel_writes = True  # the C++ decode kernel can store rows of this cache itself
    scale = minimum = None  # only u8 caches have them

    def __init__(self, num_blocks: int, heads: int, block_size: int, head_size: int, dtype: torch.dtype) -> None:
        # Zeroed, not empty: masked-out slots are multiplied by 0 in attention, and 0 * NaN is NaN.
        self.data = lazy_zeros((num_blocks, heads, block_size, head_size), dtype)

    @staticmethod
    def bytes_per_token_head(head_size: int, dtype: torch.dtype) -> int:
        return head_size * torch.empty((), dtype=dtype).element_size()

    def write(self, x: torch.Tensor, rows: torch.Tensor) -> None:
        """x [T, heads, head_size] into the cache rows from ``slot_rows``."""
        _write_rows(self.data, x.to(self.data.dtype), rows)

    def gather(self, blocks: torch.Tensor, num_seqs: int, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs, heads, num_blocks * block_size, head_size] for a flattened block table."""
        picked = self.data.index_select(0, blocks)
        return _to_sequences(picked, num_seqs, num_blocks).to(dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[dst] = self.data[src]


class QuantizedBlockCache:
    """u8 values with a float32 scale and minimum per token and head: x ~ q * scale + minimum (the value cache)."""

    kernel_writes = False  # written with the keys by write_u8

    def __init__(self, num_blocks: int, heads: int, block_size: int, head_size: int) -> None:
        self.data = lazy_zeros((num_blocks, heads, block_size, head_size), torch.uint8)
        self.scale = lazy_zeros((num_blocks, heads, block_size, 1), torch.float32)
        self.minimum = lazy_zeros((num_blocks, heads, block_size, 1), torch.float32)

    @staticmethod
    def bytes_per_block_head(block_size: int, head_size: int) -> int:
        return block_size * (head_size + 2 * 4)

    def gather(self, blocks: torch.Tensor, num_seqs: int, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        q = self.data.index_select(0, blocks)
        x = torch.addcmul(self.minimum.index_select(0, blocks), q.to(torch.float32),
                          self.scale.index_select(0, blocks))
        return _to_sequences(x.to(dtype), num_seqs, num_blocks)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in (self.data, self.scale, self.minimum):
            t[dst] = t[src]


class ChannelQuantizedBlockCache(QuantizedBlockCache):
    """u8 keys with a float32 scale and minimum per block, head and channel: x ~ q * scale + minimum (the key
    cache), each block channel-major: data [num_blocks, heads, head_size, block_size]."""

    def __init__(self, num_blocks: int, heads: int, block_size: int, head_size: int) -> None:
        self.data = lazy_zeros((num_blocks, heads, head_size, block_size), torch.uint8)
        self.scale = lazy_zeros((num_blocks, heads, head_size), torch.float32)
        self.minimum = lazy_zeros((num_blocks, heads, head_size), torch.float32)

    @staticmethod
    def bytes_per_block_head(block_size: int, head_size: int) -> int:
        return block_size * head_size + 2 * 4 * head_size

    def gather(self, blocks: torch.Tensor, num_seqs: int, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        q = self.data.index_select(0, blocks).transpose(2, 3)
        x = torch.addcmul(self.minimum.index_select(0, blocks).unsqueeze(2), q.to(torch.float32),
                          self.scale.index_select(0, blocks).unsqueeze(2))
        return _to_sequences(x.to(dtype), num_seqs, num_blocks)


def write_u8(keys: ChannelQuantizedBlockCache, values: QuantizedBlockCache, new_keys: torch.Tensor,
             new_values: torch.Tensor, slots: torch.Tensor, kernels=None) -> None:
    """new_keys/new_values [T, heads, head_size] into a u8 layer cache at ``slots`` (a sequence's tokens in position
    order): by the C++ kernels, or in torch (the reference the kernels are tested against). Keys: each block's
    channel range grows to hold its new tokens, the block's earlier keys quantized again where it grew; values:
    each token's own range."""
    if kernels is not None:
        kernels.store_kv_u8(key_cache=keys.data, key_scale=keys.scale, key_min=keys.minimum,
                            value_cache=values.data, value_scale=values.scale, value_min=values.minimum,
                            keys=new_keys, values=new_values, slots=slots)
        return
    block_size = values.data.shape[2]
    x = new_values.float()
    lo = x.amin(dim=-1, keepdim=True)
    scale = (x.amax(dim=-1, keepdim=True) - lo).clamp_min(1e-8) / 255.0
    rows = slot_rows(slots, values.data.shape[1], block_size)
    _write_rows(values.data, ((x - lo) / scale).round_().clamp_(0, 255).to(torch.uint8), rows)
    _write_rows(values.scale, scale, rows)
    _write_rows(values.minimum, lo, rows)
    blocks, offsets = (slots // block_size).tolist(), (slots % block_size).tolist()
    start = 0
    while start < len(blocks):  # runs of tokens into one block
        end = start + 1
        while end < len(blocks) and blocks[end] == blocks[start] and offsets[end] == offsets[end - 1] + 1:
            end += 1
        block, first = blocks[start], offsets[start]
        new = new_keys[start:end].float().transpose(0, 1)  # [heads, n, head_size]
        lo, hi = new.amin(dim=1), new.amax(dim=1)
        if first:
            old_lo, old_scale = keys.minimum[block], keys.scale[block]
            old_hi = old_lo + old_scale * 255.0
            inside = (lo >= old_lo) & (hi <= old_hi)
            lo, hi = torch.where(inside, old_lo, torch.minimum(lo, old_lo)), \
                torch.where(inside, old_hi, torch.maximum(hi, old_hi))
            earlier = keys.data[block, :, :, :first].float() * old_scale.unsqueeze(2) + old_lo.unsqueeze(2)
            again = ((earlier - lo.unsqueeze(2)) * (255.0 / (hi - lo).clamp_min(1e-8)).unsqueeze(2))
            keys.data[block, :, :, :first] = torch.where(inside.unsqueeze(2), keys.data[block, :, :, :first],
                                                         again.round_().clamp_(0, 255).to(torch.uint8))
        inverse = 255.0 / (hi - lo).clamp_min(1e-8)
        q = ((new - lo.unsqueeze(1)) * inverse.unsqueeze(1)).round_().clamp_(0, 255).to(torch.uint8)
        keys.data[block, :, :, first:first + end - start] = q.transpose(1, 2)
        keys.scale[block] = (hi - lo).clamp_min(1e-8) / 255.0
        keys.minimum[block] = lo
        start = end


def kernel_arguments(keys: BlockCache | QuantizedBlockCache, values: BlockCache | QuantizedBlockCache) -> dict:
    """A layer's caches as the C++ attention kernels' keyword arguments."""
    return dict(key_cache=keys.data, value_cache=values.data, key_scale=keys.scale, key_min=keys.minimum,
                value_scale=values.scale, value_min=values.minimum)


def slot_rows(slots: torch.Tensor, heads: int, block_size: int) -> torch.Tensor:
    """[T * heads] row of each (token, head) in a cache viewed as [num_blocks * heads * block_size, head_size];
    computed once per step for all layers. One row copy (index_copy_) beats the equivalent two-index assignment
    into the 4-d cache."""
    blocks, offsets = slots // block_size, slots % block_size
    return ((blocks.unsqueeze(1) * heads + torch.arange(heads)) * block_size + offsets.unsqueeze(1)).reshape(-1)


def _write_rows(cache: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> None:
    cache.view(-1, cache.shape[-1]).index_copy_(0, rows, x.reshape(-1, cache.shape[-1]))


def _to_sequences(picked: torch.Tensor, num_seqs: int, num_blocks: int) -> torch.Tensor:
    """[num_seqs * num_blocks, H, bs, D] -> [num_seqs, H, num_blocks * bs, D]."""
    _, heads, bs, dim = picked.shape
    return picked.view(num_seqs, num_blocks, heads, bs, dim).transpose(1, 2).reshape(num_seqs, heads,
                                                                                    num_blocks * bs, dim)


def make_layer_caches(kind: str, num_blocks: int, heads: int, block_size: int, head_size: int,
                      dtype: torch.dtype) -> tuple:
    """(keys, values) of one layer; ``kind`` is "u8" or "plain" (in ``dtype``)."""
    if kind == "u8":
        return (ChannelQuantizedBlockCache(num_blocks, heads, block_size, head_size),
                QuantizedBlockCache(num_blocks, heads, block_size, head_size))
    return (BlockCache(num_blocks, heads, block_size, head_size, dtype),
            BlockCache(num_blocks, heads, block_size, head_size, dtype))


def block_tensors(caches: list[tuple]) -> list[torch.Tensor]:
    """Every tensor of every layer's keys and values, each indexed by block id first."""
    return [t for pair in caches for cache in pair for t in (cache.data, cache.scale, cache.minimum) if t is not None]


def commit_first_blocks(caches: list[tuple], count: int) -> bool:
    """Back the first ``count`` blocks of every layer's tensors with memory now: the allocator hands out the lowest
    block ids first, and their pages would otherwise be faulted in by the first steps' writes."""
    return all([commit(t.data_ptr(), count * t.stride(0) * t.element_size()) for t in block_tensors(caches)])


def bytes_per_block(kind: str, num_layers: int, heads: int, block_size: int, head_size: int,
                    dtype: torch.dtype) -> int:
    if kind == "u8":
        per_head = (ChannelQuantizedBlockCache.bytes_per_block_head(block_size, head_size)
                    + QuantizedBlockCache.bytes_per_block_head(block_size, head_size))
        return num_layers * heads * per_head
    return 2 * num_layers * heads * block_size * BlockCache.bytes_per_token_head(head_size, dtype)
