"""The paged KV cache: the compiled model's key_cache.N / value_cache.N inputs over engine-owned memory.

Shapes and element types are read back from the compiled model, never computed by hand: the CPU plugin
fixes the block size (32) and, for u8, adds rows (keys: per-channel scale and zero point) and columns
(values: per-token scale and zero point) to every block. Each tensor wraps one numpy uint8 array with a
row per block, so copying a block is a row copy whatever the element type.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedllm.backends.common.memory import blocks_to_commit, commit
from pagedllm.utils import cdiv

CACHE_PREFIXES = ("key_cache.", "value_cache.")


@dataclasses.dataclass(frozen=True)
class CacheInput:
    name: str
    block_shape: tuple[int, ...]  # one block: [kv heads, token rows, columns]
    element_type: object  # openvino.Type
    bytes_per_block: int


class PagedKVCache:
    def __init__(self, compiled_model) -> None:
        self.inputs = [_cache_input(port) for port in compiled_model.inputs
                       if port.get_any_name().startswith(CACHE_PREFIXES)]
        if not self.inputs:
            raise RuntimeError("the compiled model has no key_cache/value_cache inputs: paged attention missing")
        self.buffers: list[np.ndarray] = []

    @property
    def num_layers(self) -> int:
        return len(self.inputs) // 2

    @property
    def value_block_shape(self) -> tuple[int, ...]:
        return next(i.block_shape for i in self.inputs if i.name.startswith("value_cache."))

    @property
    def block_size(self) -> int:
        """Tokens per block: the token dimension of the value cache (keys may carry extra u8 rows)."""
        return self.value_block_shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.value_block_shape[0]

    @property
    def element_type(self) -> str:
        return self.inputs[0].element_type.get_type_name()

    def bytes_per_block(self) -> int:
        return sum(i.bytes_per_block for i in self.inputs)

    def allocate(self, num_blocks: int, request) -> int:
        """Zeroed memory bound to the infer request. The blocks the allocator hands out first (the lowest ids) are
        committed now (see blocks_to_commit); the rest as they are first written. Returns how many were."""
        import openvino as ov

        self.buffers = []
        for cache in self.inputs:
            buffer = _aligned_zeros(num_blocks, cache.bytes_per_block)
            request.set_tensor(cache.name, ov.Tensor(buffer, ov.Shape([num_blocks, *cache.block_shape]),
                                                     cache.element_type))
            self.buffers.append(buffer)
        first = blocks_to_commit(num_blocks, self.bytes_per_block())
        committed = all([commit(b.ctypes.data, first * b.shape[1]) for b in self.buffers])
        return first if committed else 0

    @property
    def num_blocks(self) -> int:
        return len(self.buffers[0]) if self.buffers else 0

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        for buffer in self.buffers:
            buffer[dst] = buffer[src]


def _cache_input(port) -> CacheInput:
    shape = port.get_partial_shape()
    block_shape = tuple(dim.get_length() for dim in list(shape)[1:])
    element_type = port.get_element_type()
    # Bit width, not numpy itemsize: u4 packs two per byte, and bf16 has no numpy dtype.
    bits = int(np.prod(block_shape)) * element_type.bitwidth
    return CacheInput(port.get_any_name(), block_shape, element_type, cdiv(bits, 8))


def _aligned_zeros(rows: int, row_bytes: int, alignment: int = 64) -> np.ndarray:
    """numpy's large arrays start 16 bytes past a page, so every 64-byte vector load of the plugin's attention
    would straddle two cache lines. A block of any head size that is a multiple of 32 is a whole number of cache
    lines, so aligning the start aligns every block."""
    raw = np.zeros(rows * row_bytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + rows * row_bytes].reshape(rows, row_bytes)
