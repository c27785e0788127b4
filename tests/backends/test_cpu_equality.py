"""Greedy output of the cpu backend equals transformers' generate, token for token, in float32."""

import pytest

from equality_support import GREEDY, assert_outputs_depend_on_the_prompt, build_references, token_ids
from tiny_models import ARCHITECTURES, kv_bytes_per_block
from pagedllm import LLM
from pagedllm.backends.cpu import attention

pytestmark = pytest.mark.cpu_isa  # the kernels' build follows the CPU's ISA level
LENGTHS = [1, 5, 16, 17, 31, 40, 64, 90, 7]  # block-aligned, one past a block, single token, ...


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    return build_references(tiny_model_dirs, ARCHITECTURES, LENGTHS, prefix_len=50, short_prefix_len=35)


def make_llm(model_dir, **kwargs):
    kwargs.setdefault("kv_cache_space", 0.05)
    return LLM(str(model_dir), backend="cpu", dtype="float32", max_model_len=256, **kwargs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_outputs_depend_on_the_prompt(references, arch):
    assert_outputs_depend_on_the_prompt(references[arch]["plain"][1])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plain(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["plain"]
    llm = make_llm(tiny_model_dirs[arch], enable_chunked_prefill=False)  # prompts run whole
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_budget_16(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["plain"]
    llm = make_llm(tiny_model_dirs[arch], enable_chunked_prefill=True, max_num_batched_tokens=16,
                   max_num_seqs=16)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.stats().batched_tokens > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_caching(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["shared"]
    llm = make_llm(tiny_model_dirs[arch], enable_prefix_caching=True)
    cache = llm.engine.kv_manager.prefix_cache
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    hits_first = cache.hits
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert cache.hits > hits_first  # the second pass reused blocks
    # Every prompt of the second pass found at least its shared full blocks.
    assert cache.hits - hits_first >= len(prompts) * 32


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_with_prefix_caching(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["shared"]
    llm = make_llm(tiny_model_dirs[arch], enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=16, max_num_seqs=8)
    # One request first, so the others find its prefix while they are chunked in.
    assert token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.kv_manager.prefix_cache.hits > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_preemption(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["plain"]
    # Room for 20 blocks of 16: one max-length (256-token) sequence fits, the whole batch does not.
    space = 20 * kv_bytes_per_block(arch) / 2**30
    llm = make_llm(tiny_model_dirs[arch], kv_cache_space=space)
    assert llm.engine.num_blocks == 20
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.allocator.num_used == 0  # everything freed at the end


@pytest.mark.parametrize("arch", ["llama"])
def test_prefix_caching_with_evictions_and_preemption(tiny_model_dirs, references, arch):
    """A pool too small for everything: cached blocks get evicted and reused, requests preempted."""
    shared, shared_expected = references[arch]["shared"]
    plain, plain_expected = references[arch]["plain"]
    space = 20 * kv_bytes_per_block(arch) / 2**30
    llm = make_llm(tiny_model_dirs[arch], kv_cache_space=space, enable_prefix_caching=True,
                   enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8)
    for prompts, expected in [(shared, shared_expected), (plain, plain_expected), (shared, shared_expected)]:
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.prefix_cache.hits > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_shared_within_one_step(tiny_model_dirs, references, arch, monkeypatch):
    """Prompts with a common prefix admitted in the same step share its blocks while they are computed, and their
    decodes read those blocks once for all of them."""
    prompts, expected = references[arch]["shared"]
    shared = []
    real = attention.shared_prefix_blocks
    monkeypatch.setattr(attention, "shared_prefix_blocks", lambda *a: shared.append(real(*a)) or shared[-1])
    llm = make_llm(tiny_model_dirs[arch], enable_prefix_caching=True)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.kv_manager.prefix_cache.hits >= (len(prompts) - 2) * 32  # all but the first hit 2+ blocks
    assert max(shared) == 2  # the 32 tokens all five prompts begin with (the shortest has 35 of the 50)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_pure_torch_attention(tiny_model_dirs, references, arch, monkeypatch):
    """The fallback where the C++ kernels cannot be built: gather + SDPA, prompt chunks behind cached prefixes
    and in length buckets, the same tokens."""
    monkeypatch.setenv("PAGEDLLM_CPU_ATTENTION", "torch")
    prompts, expected = references[arch]["shared"]
    llm = make_llm(tiny_model_dirs[arch], enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=48, max_num_seqs=8)
    assert llm.engine.backend.runner.kernels is None
    assert token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.kv_manager.prefix_cache.hits > 0
