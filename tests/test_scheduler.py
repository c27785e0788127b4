"""The scheduler as a data structure: no model, tokens "computed" by bookkeeping only."""

from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.scheduler import Scheduler

BS = 4


def make(num_blocks=100, budget=64, max_seqs=8, chunked=False, caching=False):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(kv, max_seqs, budget, chunked), kv


def add(sched, rid, n, max_tokens=8):
    r = Request(rid, [1000 + i for i in range(n)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched.add_request(r)
    return r


def step(sched, sample_token=7):
    """Schedule, pretend the forward pass ran, append a token to every request that completed its tokens."""
    out = sched.schedule()
    sched.update_after_step(out)
    for item in out.scheduled:
        r = item.request
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(sample_token)
    return out


def plan(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_decodes_first_then_chunks_then_new():
    sched, _ = make(budget=10, chunked=True)
    add(sched, "a", 3)
    add(sched, "b", 20)
    assert plan(step(sched)) == [("a", 3), ("b", 7)]  # b is cut to the remaining budget
    add(sched, "c", 5)
    assert plan(step(sched)) == [("a", 1), ("b", 9)]  # a decodes, b continues; no room for c
    assert plan(step(sched)) == [("a", 1), ("b", 4), ("c", 5)]


def test_a_prompt_in_progress_leaves_room_for_a_newcomer_while_it_waits():
    kv = KVCacheManager(100, BS, False)
    sched = Scheduler(kv, 8, 16, True, long_prefill_token_threshold=8)
    add(sched, "long", 60)
    assert plan(step(sched)) == [("long", 16)]  # alone: the whole budget
    add(sched, "short", 6)
    assert plan(step(sched)) == [("long", 8), ("short", 6)]  # the short prompt starts in the very next step
    assert plan(step(sched)) == [("short", 1), ("long", 15)]  # nobody waits: the whole budget again


def test_chunk_sizes_under_a_budget():
    sched, _ = make(budget=16, chunked=True)
    add(sched, "a", 50)
    sizes = [plan(step(sched))[0][1] for _ in range(4)]
    assert sizes == [16, 16, 16, 2]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched, _ = make(budget=10, chunked=False)
    add(sched, "a", 6)
    add(sched, "b", 6)
    assert plan(step(sched)) == [("a", 6)]
    assert plan(step(sched)) == [("a", 1), ("b", 6)]


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_seqs=2)
    for rid in "abc":
        add(sched, rid, 2)
    assert [rid for rid, _ in plan(step(sched))] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_max_num_seqs_keeps_seats_for_the_siblings_of_admitted_requests():
    """n = 3: each request's two siblings join the running set once its prompt is in, so the first step admits two
    requests (6 sequences) of 8 seats, not all of them (the soak found 18 sequences running in 8 batch rows)."""
    sched, _ = make(max_seqs=8)
    for rid in "abcd":
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(n=3, max_tokens=8)))
    assert [rid for rid, _ in plan(step(sched))] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]


def test_blocks_follow_the_tokens():
    sched, kv = make()
    r = add(sched, "a", 4)
    out = step(sched)
    assert out.scheduled[0].new_block_ids == [0]
    out = step(sched)  # token 5 needs a second block
    assert out.scheduled[0].new_block_ids == [1] and r.block_ids == [0, 1]


def test_preemption_takes_the_newest_request_and_recomputes_it():
    sched, kv = make(num_blocks=4, budget=64)
    a = add(sched, "a", 8)  # 2 blocks
    b = add(sched, "b", 7)  # 2 blocks: pool full
    step(sched)
    out = step(sched)  # a's token 9 needs a block: b (newest) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert plan(out) == [("a", 1)]
    assert b.status == RequestStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and sched.num_preemptions == 1
    assert "b" in out.released_ids
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    assert plan(out) == [("b", 8)]  # prompt + the token it had generated, recomputed


def test_the_oldest_decode_needing_a_block_preempts_the_newest():
    sched, kv = make(num_blocks=5, budget=64, chunked=True)
    add(sched, "a", 4)   # 1 block; its first generated token needs a second
    add(sched, "b", 3)   # 1 block with room left
    add(sched, "c", 12)  # 3 blocks
    step(sched)
    assert kv.allocator.num_free == 0
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["c"]
    assert sorted(plan(out)) == [("a", 1), ("b", 1)]


def test_abort_frees_blocks_at_once():
    sched, kv = make()
    r = add(sched, "a", 10)
    step(sched)
    assert kv.allocator.num_used == 3
    sched.abort("a")
    assert kv.allocator.num_used == 0 and r.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    assert "a" in sched.schedule().released_ids


def test_abort_of_a_waiting_request():
    sched, kv = make(max_seqs=1)
    add(sched, "a", 2)
    add(sched, "b", 2)
    step(sched)
    sched.abort("b")
    assert [r.request_id for r in sched.waiting] == []


def test_prefix_hit_is_scheduled_as_computed():
    sched, kv = make(caching=True)
    a = add(sched, "a", 9)
    step(sched)
    b = add(sched, "b", 9)  # same tokens as a
    out = step(sched)
    assert ("b", 1) in plan(out)  # two cached blocks (8 tokens), the last token recomputed
    assert b.block_ids[:2] == a.block_ids[:2]


def test_same_step_prefix_sharing():
    kv = KVCacheManager(12, BS, True, cache_on_allocate=True)
    sched = Scheduler(kv, 8, 64, True)
    a = add(sched, "a", 9)
    b = add(sched, "b", 9)  # the same 9 tokens
    out = step(sched)
    assert plan(out) == [("a", 9), ("b", 1)]  # b shares a's two full blocks within the step
    assert b.block_ids[:2] == a.block_ids[:2]


def test_priority_policy_admits_by_priority_and_preempts_the_lowest():
    kv = KVCacheManager(6, BS, False)
    sched = Scheduler(kv, 8, 64, False, policy="priority")
    for rid, priority in (("late-low", 5), ("high", -1), ("mid", 0), ("high-later", -1)):
        r = Request(rid, [1000 + i for i in range(8)], SamplingParams(max_tokens=8, ignore_eos=True),
                    priority=priority)
        sched.add_request(r)
    assert [r.request_id for r in sched.waiting] == ["high", "high-later", "mid", "late-low"]
    assert plan(step(sched)) == [("high", 8), ("high-later", 8), ("mid", 8)]  # 6 blocks: no room for late-low
    out = step(sched)  # each needs a third block now: the lowest priority running one is preempted
    assert [r.request_id for r in out.preempted] == ["mid"]
    assert [r.request_id for r in sched.waiting] == ["mid", "late-low"]
