"""Greedy output of every backend equals transformers' generate, token for token, in float32: plain, with chunked
prefill, prefix caching (and both), and preemption; then what only one backend has (the cpu backend's shared-prefix
decode and its pure torch fallback, the openvino backend's block copies for n > 1)."""

from __future__ import annotations

import dataclasses

import pytest
from equality_support import GREEDY, NEW_TOKENS, assert_outputs_depend_on_the_prompt, build_references, token_ids
from openvino_support import requires_openvino
from tiny_models import ARCHITECTURES, hf_greedy, kv_bytes_per_block, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.layers import attention


@dataclasses.dataclass(frozen=True)
class Case:
    architectures: tuple[str, ...]
    lengths: list[int]  # prompt lengths around the block size: one short, aligned, one past, a single token
    prefix_len: int  # the shared prompts' common prefix, and the shortest of them
    short_prefix_len: int
    block_size: int
    preemption_blocks: int  # a pool where one max-length (256-token) sequence fits and the whole batch does not
    marks: tuple


CASES = {
    # the kernels' build follows the CPU's ISA level: CI runs these again as the other kind of CPU
    "cpu": Case(ARCHITECTURES, [1, 5, 16, 17, 31, 40, 64, 90, 7], 50, 35, 16, 20, (pytest.mark.cpu_isa,)),
    "openvino": Case(("llama", "qwen2", "gpt2", "opt"), [1, 5, 31, 32, 33, 40, 64, 90, 7], 70, 40, 32, 12,
                     (requires_openvino,)),
}


def on(*backends: str, architectures: tuple[str, ...] | None = None):
    return pytest.mark.parametrize("backend,arch", [
        pytest.param(backend, arch, id=f"{backend}-{arch}", marks=CASES[backend].marks)
        for backend in backends for arch in (architectures or CASES[backend].architectures)])


every_architecture = on(*CASES)


@pytest.fixture(scope="module")
def reference_cache() -> dict:
    return {}


@pytest.fixture()
def references(backend, tiny_model_dirs, reference_cache):
    """transformers' outputs for this backend's prompts, built once per backend and architecture."""
    return _ReferencesOf(reference_cache.setdefault(backend, {}), tiny_model_dirs, CASES[backend])


class _ReferencesOf:
    def __init__(self, cached: dict, model_dirs, case: Case) -> None:
        self.cached, self.model_dirs, self.case = cached, model_dirs, case

    def __getitem__(self, arch: str) -> dict:
        if arch not in self.cached:
            case = self.case
            self.cached.update(build_references(self.model_dirs, [arch], case.lengths, case.prefix_len,
                                                case.short_prefix_len))
        return self.cached[arch]


@pytest.fixture(autouse=True)
def _export_cache(request, monkeypatch):
    """The openvino backend's exports of the tiny models go to one folder per session."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "openvino":
        monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(request.getfixturevalue("openvino_export_dir")))


def make_llm(backend: str, model_dir, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_space", 0.05)
    return LLM(str(model_dir), backend=backend, dtype="float32", max_model_len=256, **kwargs)


@every_architecture
def test_outputs_depend_on_the_prompt(backend, arch, references):
    assert_outputs_depend_on_the_prompt(references[arch]["plain"][1])


@every_architecture
def test_plain(backend, arch, tiny_model_dirs, references):
    prompts, expected = references[arch]["plain"]
    llm = make_llm(backend, tiny_model_dirs[arch], enable_chunked_prefill=False)  # prompts run whole
    assert llm.engine.model_info.dtype == "float32"
    if backend == "openvino":
        assert llm.engine.backend.kv_cache.element_type == "f32"
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


@every_architecture
def test_chunked_prefill_budget_16(backend, arch, tiny_model_dirs, references):
    prompts, expected = references[arch]["plain"]
    llm = make_llm(backend, tiny_model_dirs[arch], enable_chunked_prefill=True, max_num_batched_tokens=16,
                   max_num_seqs=16)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


@every_architecture
def test_prefix_caching(backend, arch, tiny_model_dirs, references):
    prompts, expected = references[arch]["shared"]
    llm = make_llm(backend, tiny_model_dirs[arch], enable_prefix_caching=True)
    cache = llm.engine.kv_manager.prefix_cache
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    hits_first = cache.hits
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    # Every prompt of the second pass found at least its shared full blocks.
    assert cache.hits - hits_first >= len(prompts) * 32


@every_architecture
def test_chunked_prefill_with_prefix_caching(backend, arch, tiny_model_dirs, references):
    prompts, expected = references[arch]["shared"]
    llm = make_llm(backend, tiny_model_dirs[arch], enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=16, max_num_seqs=8)
    # One request first, so the others find its prefix while they are chunked in.
    assert token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.kv_manager.prefix_cache.hits >= (len(prompts) - 1) * 32


@every_architecture
def test_preemption(backend, arch, tiny_model_dirs, references):
    prompts, expected = references[arch]["plain"]
    case = CASES[backend]
    space = case.preemption_blocks * kv_bytes_per_block(arch, block_size=case.block_size) / 2**30
    llm = make_llm(backend, tiny_model_dirs[arch], kv_cache_space=space)
    assert llm.engine.num_blocks == case.preemption_blocks  # the cache's real bytes per block
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.allocator.num_used == 0  # everything freed at the end


@on("cpu", "openvino", architectures=("llama",))
def test_prefix_caching_with_evictions_and_preemption(backend, arch, tiny_model_dirs, references):
    """A pool too small for everything: cached blocks get evicted and reused, requests preempted."""
    shared, shared_expected = references[arch]["shared"]
    plain, plain_expected = references[arch]["plain"]
    case = CASES[backend]
    space = case.preemption_blocks * kv_bytes_per_block(arch, block_size=case.block_size) / 2**30
    llm = make_llm(backend, tiny_model_dirs[arch], kv_cache_space=space, enable_prefix_caching=True,
                   enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8)
    for prompts, expected in [(shared, shared_expected), (plain, plain_expected), (shared, shared_expected)]:
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.prefix_cache.hits > 0


@on("cpu", architectures=("llama", "qwen2"))
def test_prefix_shared_within_one_step(backend, arch, tiny_model_dirs, references, monkeypatch):
    """Prompts with a common prefix admitted in the same step share its blocks while they are computed, and their
    decodes read those blocks once for all of them."""
    prompts, expected = references[arch]["shared"]
    shared = []
    real = attention.shared_prefix_blocks
    monkeypatch.setattr(attention, "shared_prefix_blocks", lambda *a: shared.append(real(*a)) or shared[-1])
    llm = make_llm(backend, tiny_model_dirs[arch], enable_prefix_caching=True)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.kv_manager.prefix_cache.hits >= (len(prompts) - 2) * 32  # all but the first hit 2+ blocks
    assert max(shared) == 2  # the 32 tokens all five prompts begin with (the shortest has 35 of the 50)


@on("cpu")
def test_pure_torch_attention(backend, arch, tiny_model_dirs, references, monkeypatch):
    """The fallback where the C++ kernels cannot be built: gather + SDPA, prompt chunks behind cached prefixes
    and in length buckets, the same tokens."""
    monkeypatch.setenv("PAGEDLLM_CPU_ATTENTION", "torch")
    prompts, expected = references[arch]["shared"]
    llm = make_llm(backend, tiny_model_dirs[arch], enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=48, max_num_seqs=8)
    assert llm.engine.backend.runner.kernels is None
    assert token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.kv_manager.prefix_cache.hits > 0


@pytest.mark.parametrize("prompt_len", [37, 64])  # a partial last block (copied), and none
@on("openvino", architectures=("llama",))
def test_parallel_samples_share_and_copy_blocks(backend, arch, tiny_model_dirs, prompt_len):
    """n > 1 forks share the prompt's full blocks and copy the partial one through copy_blocks."""
    llm = make_llm(backend, tiny_model_dirs[arch])
    prompt = random_prompts([prompt_len], seed=prompt_len)[0]
    single = llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    params = SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single] * 3
    assert single == hf_greedy(tiny_model_dirs[arch], [prompt], NEW_TOKENS)[0]


@on("cpu", "openvino", architectures=("llama", "qwen2"))
def test_prompt_logprobs_with_chunks_prefix_caching_and_preemption(backend, arch, tiny_model_dirs, references):
    """Each prompt token's logprob equals transformers' log-softmax, whether the prompt runs in 16-token chunks,
    shares a cached prefix (the request computes it again: a cache hit has no logits) or is preempted and
    recomputed; the generated tokens stay transformers' greedy ones."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts, expected = references[arch]["shared"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32)
    with torch.inference_mode():
        oracle = [torch.log_softmax(model(torch.tensor([p])).logits[0], dim=-1) for p in prompts]
    case = CASES[backend]
    space = case.preemption_blocks * kv_bytes_per_block(arch, block_size=case.block_size) / 2**30
    llm = make_llm(backend, tiny_model_dirs[arch], kv_cache_space=space, enable_prefix_caching=True,
                   enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8)
    params = dataclasses.replace(GREEDY, prompt_logprobs=2)
    assert token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]  # its blocks are cached
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output, logprobs in zip(prompts, outputs, oracle):
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        assert output.num_cached_tokens == 0
        for i, (token, entry) in enumerate(zip(prompt[1:], output.prompt_logprobs[1:])):
            row = logprobs[i]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(2)
            assert [entry[t].logprob for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert llm.engine.kv_manager.allocator.num_used == 0
