from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(rid, n):
    return Request(rid, list(range(n)), SamplingParams(max_tokens=8, ignore_eos=True))


def test_allocates_only_the_blocks_needed():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r = make_request("a", 5)
    assert kv.allocate_slots(r, 5) == [0, 1]
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 1) == []  # token 6 fits block 1
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1) == [2]


def test_no_room_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    r = make_request("a", 12)
    assert kv.allocate_slots(r, 12) is None
    assert r.block_ids == [] and kv.allocator.num_free == 2


def test_usage_and_waste():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    r = make_request("a", 5)
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    assert kv.allocator.num_used == 2
    assert KVCacheManager.waste([r], 4) == 3 / 8
    kv.free(r)
    assert kv.allocator.num_used == 0 and r.block_ids == []
