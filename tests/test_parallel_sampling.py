"""n > 1: the n sequences of a request share the prompt's KV blocks; the partial block is copied."""

import pytest
from tiny_models import kv_bytes_per_block, random_prompts

from pagedllm import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_space=0.01, max_num_seqs=16)


@pytest.mark.parametrize("prompt_len", [21, 32])  # a partial last block, and none
def test_greedy_siblings_equal_the_single_sequence(llm, prompt_len):
    prompt = random_prompts([prompt_len], seed=prompt_len)[0]
    single = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [single[0].token_ids] * 3
    assert all(c.text == single[0].text for c in out.outputs)


def test_siblings_share_full_blocks_and_copy_the_partial_one(llm):
    engine = llm.engine
    prompt = random_prompts([2 * engine.config.block_size + 5], seed=5)[0]  # 2 full blocks + 5 tokens
    engine.add_request("g", prompt, SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    outputs = engine.step()  # prefill + fork + first tokens
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2]
    members = engine._groups["g"].members
    tables = [m.block_ids for m in members]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    refs = engine.kv_manager.allocator.ref_counts
    assert [refs[b] for b in tables[0][:2]] == [3, 3]
    assert len({t[2] for t in tables}) == 3  # each sequence writes its own copy of the partial block
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.allocator.num_used == 0


def test_seeded_siblings_differ_and_reproduce(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    first = llm.generate("Paris is", params, use_tqdm=False)[0]
    again = llm.generate(["x", "Paris is"], params, use_tqdm=False)[1]
    texts = [c.token_ids for c in first.outputs]
    assert len({tuple(t) for t in texts}) > 1
    assert texts == [c.token_ids for c in again.outputs]


def test_streamed_outputs_carry_only_the_sequences_that_progressed(llm):
    engine = llm.engine
    engine.add_request("s", [5, 6, 7], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                      stop_token_ids=[]))
    per_index: dict[int, list[int]] = {0: [], 1: []}
    finished = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                per_index[c.index] += c.delta_token_ids
            finished = out.finished
    assert finished and [len(v) for v in per_index.values()] == [6, 6]


def test_n_under_memory_pressure(tiny_llama):
    """Too few blocks for all siblings at once: forks fall back to recompute, sequences are preempted."""
    space = 18 * kv_bytes_per_block("llama") / 2**30
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_space=space, max_num_seqs=8)
    prompts = random_prompts([60, 45], seed=9)
    single = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40,
                                                                       ignore_eos=True), use_tqdm=False)]
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[s] * 3 for s in single]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.allocator.num_used == 0


def test_n_above_max_num_seqs_is_refused(llm):
    with pytest.raises(InvalidRequestError, match=r"n \(17\) is more than max_num_seqs \(16\)"):
        llm.generate("x", SamplingParams(n=17))


def test_abort_stops_every_sequence(llm):
    engine = llm.engine
    engine.add_request("a", [5] * 30, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 3
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.kv_manager.allocator.num_used == 0
