"""Between the scheduler and the block pool: "how much of this request is cached already" and
"make room for N more tokens of it, or say there is none"."""

from __future__ import annotations

from pagedllm.kv.block_allocator import BlockAllocator
from pagedllm.kv.prefix_cache import PrefixCache, chain_hashes, root_hash
from pagedllm.request import Request
from pagedllm.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 cache_on_allocate: bool = False) -> None:
        """``cache_on_allocate``: publish a step's full blocks when they are allocated, so requests admitted
        later in the same step already share them. Only for backends that write every token's keys and values
        before any attention reads them within a forward pass."""
        self.block_size = block_size
        self.cache_on_allocate = cache_on_allocate
        self.num_blocks = num_blocks
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        cache = self.prefix_cache
        self.allocator = BlockAllocator(num_blocks, on_evict=cache.evict if cache is not None else None,
                                        is_cached=cache.holds if cache is not None else None)

    # -- lookups -------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens (never all of them: the last token
        must be computed to have logits to sample from). None for a request that needs its prompt's logits."""
        if self.prefix_cache is None or request.num_computed_tokens > 0 or request.needs_prompt_logprobs:
            return []
        chain_hashes(request.all_token_ids, self.block_size, request.block_hashes, root=_root(request))
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.prefix_cache.lookup(request.block_hashes[:max_blocks], request.all_token_ids, _root(request))

    # -- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Give the request blocks for ``num_new_tokens`` more tokens after its computed ones (and
        after ``computed_blocks``, a prefix-cache hit being admitted). Returns the block ids appended
        to the request's table, or None if the pool cannot hold them (nothing changes then)."""
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, needed - len(request.block_ids) - len(computed_blocks))
        ref_counts = self.allocator.ref_counts
        num_revived = sum(1 for b in computed_blocks if ref_counts[b] == 0)  # free now, taken by the hit
        if num_new_blocks + num_revived > self.allocator.num_free:
            return None
        self.allocator.touch(computed_blocks)
        new_blocks = self.allocator.allocate(num_new_blocks)
        appended = computed_blocks + new_blocks
        request.block_ids.extend(appended)
        if self.prefix_cache is not None and request.num_computed_tokens == 0:  # admission
            self.prefix_cache.record(request.num_tokens, len(computed_blocks) * self.block_size)
            request.num_cached_blocks = len(computed_blocks)
        request.num_published_blocks = request.num_cached_blocks
        if self.cache_on_allocate:  # the request's own tokens only: proposed ones may be rejected
            self._publish(request, min(num_computed + num_new_tokens, request.num_tokens))
        return appended

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's newly computed full blocks in the prefix cache (after a step ran)."""
        self._publish(request, request.num_computed_tokens)

    def unpublish_step(self, request: Request) -> None:
        """Withdraw the blocks published when this step allocated them: the request is preempted before the
        step runs, so they will never be computed."""
        if self.prefix_cache is None:
            return
        for block in request.block_ids[request.num_published_blocks:request.num_cached_blocks]:
            self.prefix_cache.evict(block)
        request.num_cached_blocks = request.num_published_blocks

    def _publish(self, request: Request, num_tokens: int) -> None:
        if self.prefix_cache is None:
            return
        num_full = num_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        bs = self.block_size
        hashes = chain_hashes(request.all_token_ids, bs, request.block_hashes, num_full * bs, _root(request))
        tokens = request.all_token_ids
        for i in range(request.num_cached_blocks, num_full):
            parent = hashes[i - 1] if i > 0 else _root(request)
            self.prefix_cache.insert(request.block_ids[i], hashes[i], parent, tokens[i * bs:(i + 1) * bs])
        request.num_cached_blocks = num_full

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give ``child`` the parent's computed KV: full blocks shared by reference, the partial last
        block copied (it is about to be written by both). Returns the (source, destination) block pair
        the backend must copy, (−1, −1) if there is no partial block, or None if no block is free."""
        bs = self.block_size
        num_full, partial = divmod(parent.num_computed_tokens, bs)
        if partial and self.allocator.num_free == 0:
            return None
        shared = parent.block_ids[:num_full]
        self.allocator.touch(shared)
        child.block_ids = list(shared)
        copy = (-1, -1)
        if partial:
            (new_block,) = self.allocator.allocate(1)
            child.block_ids.append(new_block)
            copy = (parent.block_ids[num_full], new_block)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        return copy

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes first so shared prefixes outlive it in the LRU."""
        self.allocator.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0

    # -- numbers -------------------------------------------------------------------------------
    @staticmethod
    def waste(requests: list[Request], block_size: int) -> float:
        """Allocated slots not holding a token, over allocated slots, across ``requests``."""
        allocated = sum(len(r.block_ids) for r in requests) * block_size
        if allocated == 0:
            return 0.0
        held = sum(min(r.num_computed_tokens, len(r.block_ids) * block_size) for r in requests)
        return (allocated - held) / allocated


def _root(request: Request) -> int:
    """Where the request's chain of block hashes starts: one adapter's blocks are its own (see root_hash)."""
    if request.cache_root is None:
        request.cache_root = root_hash(request.params.lora_request)
    return request.cache_root
