from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.kv.prefix_cache import PrefixCache, chain_hashes, root_hash
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_request(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=8, ignore_eos=True))


def run_prefill(kv, request):
    """Admit a request the way the scheduler does and mark its prompt computed."""
    cached = kv.get_computed_blocks(request)
    num_cached = len(cached) * BS
    new = kv.allocate_slots(request, request.num_tokens - num_cached, cached)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return cached


def test_hashes_chain_over_the_prefix():
    a = chain_hashes(list(range(8)), BS, [])
    b = chain_hashes([9, 9, 9, 9] + list(range(4, 8)), BS, [])
    assert len(a) == 2 and a[1] != b[1]  # same second block, different parent
    assert chain_hashes(list(range(8)) + [1, 2], BS, []) == a  # partial block not hashed
    assert chain_hashes(list(range(12)), BS, list(a))[:2] == a  # extends in place


def test_hit_reuses_exact_block_ids_and_counts_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))  # blocks 0,1 full, 2 partial
    run_prefill(kv, first)
    assert first.block_ids == [0, 1, 2]
    second = make_request("b", list(range(8)) + [77, 78, 79])
    cached = run_prefill(kv, second)
    assert cached == [0, 1]
    assert second.block_ids == [0, 1, 3]
    assert kv.allocator.ref_counts[:4] == [2, 2, 1, 1]
    cache = kv.prefix_cache
    assert (cache.queries, cache.hits) == (10 + 11, 8)


def test_the_last_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True)
    run_prefill(kv, make_request("a", list(range(8))))
    again = make_request("b", list(range(8)))  # fully cached, but needs logits of token 7
    assert kv.get_computed_blocks(again) == [0]


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))  # 2 full blocks + 1
    run_prefill(kv, a)
    kv.free(a)
    # The partial block 2 holds nothing cached: reused first. The full blocks go to the back, tail first, so 0
    # (the shared root) is evicted last.
    assert kv.allocator.free_order() == [2, 3, 1, 0]
    b = make_request("b", list(range(8)) + [5])
    assert run_prefill(kv, b) == [0, 1]
    kv.free(b)
    c = make_request("c", [50 + i for i in range(13)])  # needs 4 blocks: evicts everything
    run_prefill(kv, c)
    assert len(kv.prefix_cache) == 3  # c's three full blocks; a's and b's are gone
    d = make_request("d", list(range(8)) + [5])
    assert kv.get_computed_blocks(d) == []


def test_a_hash_collision_is_a_miss():
    cache = PrefixCache(BS)
    tokens = [1, 2, 3, 4]
    (h,) = chain_hashes(tokens, BS, [])
    cache.insert(7, h, root_hash(), tokens)
    assert cache.lookup([h], tokens) == [7]
    assert cache.lookup([h], [1, 2, 3, 5]) == []  # same hash, other tokens


def test_without_prefix_caching_nothing_is_shared():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    run_prefill(kv, make_request("a", list(range(10))))
    b = make_request("b", list(range(10)))
    assert kv.get_computed_blocks(b) == []


def test_cache_on_allocate_lets_a_request_of_the_same_step_share():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True, cache_on_allocate=True)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]  # not computed yet, but published
    b = make_request("b", list(range(8)) + [40, 41])
    assert kv.get_computed_blocks(b) == [0, 1]


def test_a_preempted_request_withdraws_what_it_published_this_step():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=True, cache_on_allocate=True)
    a = make_request("a", list(range(10)))
    kv.allocate_slots(a, 10)
    kv.unpublish_step(a)
    assert len(kv.prefix_cache) == 0 and a.num_cached_blocks == 0


def test_adapters_never_share_blocks_with_each_other_or_the_base_model():
    from pagedllm.lora_request import LoRARequest
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)

    def request(rid, lora=None):
        return Request(rid, list(range(10)), SamplingParams(max_tokens=4, lora_request=lora))

    a, a_again = LoRARequest("a", 1, "/adapters/a"), LoRARequest("a", 1, "/adapters/a")
    run_prefill(kv, request("base"))
    assert kv.get_computed_blocks(request("lora", a)) == []  # the same text under an adapter: other KV
    run_prefill(kv, request("lora", a))
    assert len(kv.get_computed_blocks(request("lora-again", a_again))) == 2
    assert kv.get_computed_blocks(request("b", LoRARequest("b", 2, "/adapters/b"))) == []
    assert kv.get_computed_blocks(request("a-reloaded", LoRARequest("a", 1, "/adapters/a-v2"))) == []
    assert len(kv.get_computed_blocks(request("base-again"))) == 2
