"""Greedy output of the openvino backend equals transformers' generate, token for token, in float32."""

import pytest

from equality_support import NEW_TOKENS, GREEDY, assert_outputs_depend_on_the_prompt, build_references, token_ids
from openvino_support import requires_openvino, tiny_export_cache  # noqa: F401
from tiny_models import hf_greedy, kv_bytes_per_block, random_prompts
from pagedllm import LLM, SamplingParams

pytestmark = [requires_openvino, pytest.mark.usefixtures("tiny_export_cache")]

ARCHITECTURES = ("llama", "qwen2", "gpt2", "opt")
LENGTHS = [1, 5, 31, 32, 33, 40, 64, 90, 7]  # around the 32-token block: one short, aligned, one past


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    return build_references(tiny_model_dirs, ARCHITECTURES, LENGTHS, prefix_len=70, short_prefix_len=40)


def make_llm(model_dir, **kwargs):
    kwargs.setdefault("kv_cache_space", 0.05)
    return LLM(str(model_dir), backend="openvino", dtype="float32", max_model_len=256, **kwargs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_outputs_depend_on_the_prompt(references, arch):
    assert_outputs_depend_on_the_prompt(references[arch]["plain"][1])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plain(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["plain"]
    llm = make_llm(tiny_model_dirs[arch], enable_chunked_prefill=False)  # prompts run whole
    assert llm.engine.backend.kv_cache.element_type == "f32" and llm.engine.model_info.dtype == "float32"
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_small_budget(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["plain"]
    llm = make_llm(tiny_model_dirs[arch], enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=16)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_caching(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["shared"]
    llm = make_llm(tiny_model_dirs[arch], enable_prefix_caching=True)
    cache = llm.engine.kv_manager.prefix_cache
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    hits_first = cache.hits
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    # Every prompt of the second pass found at least its first full block of 32 tokens.
    assert cache.hits - hits_first >= len(prompts) * 32


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_with_prefix_caching(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["shared"]
    llm = make_llm(tiny_model_dirs[arch], enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=16, max_num_seqs=8)
    # One request first, so the others find its prefix while they are chunked in.
    assert token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.kv_manager.prefix_cache.hits >= (len(prompts) - 1) * 32


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_preemption(tiny_model_dirs, references, arch):
    prompts, expected = references[arch]["plain"]
    # Room for 12 blocks of 32: one max-length (256-token) sequence fits, the whole batch does not.
    space = 12 * kv_bytes_per_block(arch, block_size=32) / 2**30
    llm = make_llm(tiny_model_dirs[arch], kv_cache_space=space)
    assert llm.engine.num_blocks == 12  # the f32 cache's real bytes per block, read from the compiled model
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.allocator.num_used == 0


@pytest.mark.parametrize("prompt_len", [37, 64])  # a partial last block (copied), and none
def test_parallel_samples_share_and_copy_blocks(tiny_model_dirs, prompt_len):
    """n > 1 forks share the prompt's full blocks and copy the partial one through copy_blocks."""
    llm = make_llm(tiny_model_dirs["llama"])
    prompt = random_prompts([prompt_len], seed=prompt_len)[0]
    single = llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    params = SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single] * 3
    assert single == hf_greedy(tiny_model_dirs["llama"], [prompt], NEW_TOKENS)[0]
