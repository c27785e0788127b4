import pytest

from pagedllm.kv.block_allocator import BlockAllocator, NoFreeBlocksError


def test_allocates_in_order_and_counts():
    a = BlockAllocator(4)
    assert a.allocate(2) == [0, 1]
    assert a.num_free == 2 and a.num_used == 2
    assert a.ref_counts == [1, 1, 0, 0]


def test_freed_blocks_holding_nothing_are_reused_first():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    a.free([blocks[1], blocks[0]])
    assert a.free_order() == [0, 1, 3]  # the never-used block 3 comes after them
    assert a.allocate(3) == [0, 1, 3]


def test_freed_blocks_holding_a_cached_prefix_go_to_the_back():
    a = BlockAllocator(4, is_cached=lambda block: block == 1)
    a.allocate(3)
    a.free([1, 0, 2])
    assert a.free_order() == [2, 0, 3, 1]  # 1 is evicted last, after every block that holds nothing


def test_touch_revives_a_free_block_and_shares_a_used_one():
    a = BlockAllocator(4)
    a.allocate(2)  # 0, 1
    a.free([1])
    a.touch([1, 0])
    assert a.ref_counts[:2] == [2, 1]
    assert a.free_order() == [2, 3]
    a.free([0])
    assert a.ref_counts[0] == 1 and 0 not in a.free_order()


def test_running_out_raises_and_changes_nothing():
    a = BlockAllocator(2)
    a.allocate(1)
    with pytest.raises(NoFreeBlocksError):
        a.allocate(2)
    assert a.num_free == 1


def test_double_free_is_caught():
    a = BlockAllocator(2)
    (b,) = a.allocate(1)
    a.free([b])
    with pytest.raises(RuntimeError):
        a.free([b])


def test_eviction_callback_fires_when_a_block_is_reused():
    evicted = []
    a = BlockAllocator(2, on_evict=evicted.append)
    a.allocate(2)
    a.free([1, 0])
    a.allocate(1)
    assert evicted == [0, 1, 0]  # every allocation tells the cache; block 0, freed last, was reused first
