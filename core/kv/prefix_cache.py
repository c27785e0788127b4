"""Content-addressed full KV blocks, so requests that share a prompt prefix share its blocks.

A block's key chains the parent block's hash with this block's token ids, so a hit on block k
implies the whole prefix up to k matches. Every hit is confirmed against the stored tokens and
parent hash, so a hash collision can never hand out the wrong KV.
"""

from __future__ import annotations

from typing import Sequence

_ROOT_HASH = 0x5A17ED


def root_hash(lora_request=None) -> int:
    """Where a request's chain of block hashes starts: the base model's root, or one of the adapter's own (its
    name, id and path: an id loaded again with other weights starts another chain)."""
    if lora_request is None:
        return _ROOT_HASH
    return hash((_ROOT_HASH, lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path))


def chain_hashes(token_ids: Sequence[int], block_size: int, hashes: list[int],
                 num_tokens: int | None = None, root: int = _ROOT_HASH) -> list[int]:
    """Extend ``hashes`` (in place) to cover every full block of the first ``num_tokens`` (default:
    all) of ``token_ids``, the chain starting at ``root``; return it."""
    parent = hashes[-1] if hashes else root
    end = len(token_ids) if num_tokens is None else num_tokens
    for start in range(len(hashes) * block_size, end - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._block_of: dict[int, int] = {}  # block hash -> block id
        self._key_of: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # block id -> (hash, parent, tokens)
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens found cached

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, hashes: Sequence[int], token_ids: Sequence[int], root: int = _ROOT_HASH) -> list[int]:
        """Block ids of the longest cached prefix among the given full-block hashes (chained from ``root``)."""
        blocks: list[int] = []
        parent = root
        bs = self.block_size
        for i, h in enumerate(hashes):
            block = self._block_of.get(h)
            if block is None:
                break
            _, stored_parent, tokens = self._key_of[block]
            if stored_parent != parent or tokens != tuple(token_ids[i * bs:(i + 1) * bs]):
                break  # hash collision: treat as a miss
            blocks.append(block)
            parent = h
        return blocks

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_queried_tokens
        self.hits += num_hit_tokens

    def insert(self, block: int, block_hash: int, parent_hash: int, tokens: Sequence[int]) -> None:
        """Publish a full block (``parent_hash``: the previous block's, or the chain's root for the first). If the
        same content is already cached in another block, keep that one."""
        if block_hash in self._block_of or block in self._key_of:
            return
        self._block_of[block_hash] = block
        self._key_of[block] = (block_hash, parent_hash, tuple(tokens))

    def holds(self, block: int) -> bool:
        """Whether the block's content is published (a later request may hit it)."""
        return block in self._key_of

    def evict(self, block: int) -> None:
        """Forget a block's content: it is being reused for something else."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key[0]]
