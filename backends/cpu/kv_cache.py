"""Per-layer block caches for keys and values: plain (fp32/bf16) or u8 with a scale and minimum per
token and head (vLLM's CPU backend has no u8 cache; it holds ~1.8x the tokens of bf16 per GiB).

Layout [num_blocks, kv_heads, block_size, head_size], as IPEX's and OpenVINO's paged caches.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from calloc: the kernel hands out zero pages on first touch, so a large cache costs no start-up
    time and no resident memory until blocks are used (torch.zeros would write every byte now)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class BlockCache:
    """One layer's keys or values in the given dtype."""

    def __init__(self, num_blocks: int, heads: int, block_size: int, head_size: int, dtype: torch.dtype) -> None:
        # Zeroed, not empty: masked-out slots are multiplied by 0 in attention, and 0 * NaN is NaN.
        self.data = lazy_zeros((num_blocks, heads, block_size, head_size), dtype)

    @staticmethod
    def bytes_per_token_head(head_size: int, dtype: torch.dtype) -> int:
        return head_size * torch.empty((), dtype=dtype).element_size()

    def write(self, x: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        """x [T, heads, head_size] into slots (blocks[t], offsets[t])."""
        self.data[blocks, :, offsets] = x.to(self.data.dtype)

    def gather(self, blocks: torch.Tensor, num_seqs: int, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_seqs, heads, num_blocks * block_size, head_size] for a flattened block table."""
        picked = self.data.index_select(0, blocks)
        return _to_sequences(picked, num_seqs, num_blocks).to(dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[dst] = self.data[src]


class QuantizedBlockCache:
    """u8 values with a float32 scale and minimum per token and head: x ~ q * scale + minimum."""

    def __init__(self, num_blocks: int, heads: int, block_size: int, head_size: int) -> None:
        self.data = lazy_zeros((num_blocks, heads, block_size, head_size), torch.uint8)
        self.scale = lazy_zeros((num_blocks, heads, block_size, 1), torch.float32)
        self.minimum = lazy_zeros((num_blocks, heads, block_size, 1), torch.float32)

    @staticmethod
    def bytes_per_token_head(head_size: int, dtype: torch.dtype | None = None) -> int:
        return head_size + 2 * 4

    def write(self, x: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        x = x.float()
        lo = x.amin(dim=-1, keepdim=True)
        scale = (x.amax(dim=-1, keepdim=True) - lo).clamp_min(1e-8) / 255.0
        q = ((x - lo) / scale).round_().clamp_(0, 255).to(torch.uint8)
        self.data[blocks, :, offsets] = q
        self.scale[blocks, :, offsets] = scale
        self.minimum[blocks, :, offsets] = lo

    def gather(self, blocks: torch.Tensor, num_seqs: int, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        q = self.data.index_select(0, blocks)
        x = torch.addcmul(self.minimum.index_select(0, blocks), q.to(torch.float32),
                          self.scale.index_select(0, blocks))
        return _to_sequences(x.to(dtype), num_seqs, num_blocks)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in (self.data, self.scale, self.minimum):
            t[dst] = t[src]


def _to_sequences(picked: torch.Tensor, num_seqs: int, num_blocks: int) -> torch.Tensor:
    """[num_seqs * num_blocks, H, bs, D] -> [num_seqs, H, num_blocks * bs, D]."""
    _, heads, bs, dim = picked.shape
    return picked.view(num_seqs, num_blocks, heads, bs, dim).transpose(1, 2).reshape(num_seqs, heads,
                                                                                    num_blocks * bs, dim)


def make_layer_caches(kind: str, num_blocks: int, heads: int, block_size: int, head_size: int,
                      dtype: torch.dtype) -> tuple:
    """(keys, values) of one layer; ``kind`` is "u8" or "plain" (in ``dtype``)."""
    if kind == "u8":
        return (QuantizedBlockCache(num_blocks, heads, block_size, head_size),
                QuantizedBlockCache(num_blocks, heads, block_size, head_size))
    return (BlockCache(num_blocks, heads, block_size, head_size, dtype),
            BlockCache(num_blocks, heads, block_size, head_size, dtype))


def bytes_per_block(kind: str, num_layers: int, heads: int, block_size: int, head_size: int,
                    dtype: torch.dtype) -> int:
    per = (QuantizedBlockCache if kind == "u8" else BlockCache).bytes_per_token_head(head_size, dtype)
    return 2 * num_layers * heads * block_size * per
