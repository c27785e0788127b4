"""A fixed pool of KV block ids with reference counts and an LRU-ordered free queue.

The free queue is an ``OrderedDict``: O(1) pop from the front, append at the back, and removal from
the middle (a free block that still holds a cached prefix is taken back by a cache hit). Freed blocks
that hold a cached prefix go to the back, so the least recently used one is the first evicted. Freed blocks
that hold nothing worth keeping go to the front and are reused first: their memory is already resident and
likely still in the CPU's caches, where a never-used block costs a page fault on its first write.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable


class NoFreeBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None,
                 is_cached: Callable[[int], bool] | None = None) -> None:
        if num_blocks < 0:  # 0: an engine with no KV cache (the pooling runner)
            raise ValueError(f"num_blocks must not be negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._on_evict = on_evict
        self._is_cached = is_cached

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def free_order(self) -> list[int]:
        """Free blocks, next to be allocated first (for tests and debugging)."""
        return list(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the front of the free queue, evicting any cached content."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take another reference on blocks (a prefix-cache hit), pulling free ones out of the queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop a reference. Blocks reaching zero join the free queue in the given order: at the back if they hold a
        cached prefix, else at the front (so the last one given is the next allocated)."""
        for block in blocks:
            count = self.ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None
                if self._is_cached is None or not self._is_cached(block):
                    self._free.move_to_end(block, last=False)
