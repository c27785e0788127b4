"""Speculative decoding (n-gram prompt lookup and a draft model): greedy output equals transformers' token for token
with proposals verified in the paged batch, alongside chunked prefill, prefix caching, preemption, n > 1 and stop
strings, on both backends; sampled requests speculate reproducibly under a seed; most proposals are accepted where
the output repeats its prompt (SmolLM2 asked to copy a text), and all where the draft is the target itself."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from openvino_support import requires_openvino
from tiny_models import hf_greedy, kv_bytes_per_block, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ConfigError
from pagedllm.sched.speculation import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
NEW_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def repeating_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so the proposer finds n-grams."""
    return [p + p[:24] for p in random_prompts([30, 45, 17, 60], seed=5)]


class OracleProposer:
    """Proposes the true greedy continuation, with one token in three proposals made wrong at a random place: the
    tiny random models never repeat, so this is how every count of accepted tokens (0 to k) gets verified."""

    model = None  # proposes itself, as the n-gram lookup does

    def __init__(self, config: SpeculativeConfig, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.sequences = [(p, o) for p, o in zip(prompts, outputs)]
        self.rng = random.Random(0)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        for prompt, output in self.sequences:
            if token_ids[:len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                proposal = output[done:done + min(limit, self.num_speculative_tokens)]
                if proposal and self.rng.random() < 1 / 3:
                    proposal[self.rng.randrange(len(proposal))] = 3  # a token no continuation here has
                return proposal
        return []


@pytest.mark.parametrize("backend, arch, block_size, blocks", [
    pytest.param("cpu", "llama", 16, 20, marks=pytest.mark.cpu_isa),
    pytest.param("cpu", "qwen2", 16, 20, marks=pytest.mark.cpu_isa),
    pytest.param("openvino", "llama", 32, 10, marks=requires_openvino),
])
def test_greedy_output_equals_transformers_with_caching_chunking_and_preemption(backend, arch, block_size, blocks,
                                                                              tiny_model_dirs, monkeypatch,
                                                                              request):
    if backend == "openvino":
        monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(request.getfixturevalue("openvino_export_dir")))
    prompts = repeating_prompts()
    expected = hf_greedy(tiny_model_dirs[arch], prompts, NEW_TOKENS)
    space = blocks * kv_bytes_per_block(arch, block_size=block_size) / 2**30
    llm = LLM(str(tiny_model_dirs[arch]), backend=backend, dtype="float32", max_model_len=256, kv_cache_space=space,
              enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=8, speculative_config=NGRAM)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected  # n-gram proposals
    counters = llm.engine._counters
    proposed, accepted = counters.proposed_tokens, counters.accepted_tokens
    llm.engine.scheduler.speculative = OracleProposer(llm.engine.speculative, prompts, expected)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    proposed, accepted = counters.proposed_tokens - proposed, counters.accepted_tokens - accepted
    assert proposed > accepted > 0.5 * proposed
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.allocator.num_used == 0
    # again: the prefix cache holds what the first pass computed, never a rejected proposal
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.engine.kv_manager.prefix_cache.hits > 0
    llm.shutdown()


def test_n_stop_strings_and_sampled_requests_beside_speculation(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01, speculative_config=NGRAM)
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01)
    prompt = {"prompt_token_ids": repeating_prompts()[0]}
    text = plain.generate(prompt, GREEDY, use_tqdm=False)[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    for params in (SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop])):
        ours = llm.generate(prompt, params, use_tqdm=False)[0]
        theirs = plain.generate(prompt, params, use_tqdm=False)[0]
        assert [(c.token_ids, c.text, c.finish_reason) for c in ours.outputs] == \
            [(c.token_ids, c.text, c.finish_reason) for c in theirs.outputs]
    with_logprobs = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    llm.engine.scheduler.speculative = OracleProposer(llm.engine.speculative, [prompt["prompt_token_ids"]],
                                                      [plain.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids])
    ours = llm.generate(prompt, with_logprobs, use_tqdm=False)[0].outputs[0]
    theirs = plain.generate(prompt, with_logprobs, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids and llm.engine._counters.accepted_tokens > 0
    for mine, other in zip(ours.logprobs, theirs.logprobs):  # each token's from its own row, as without proposals
        assert list(mine) == list(other) and [lp.rank for lp in mine.values()] == [lp.rank for lp in other.values()]
        assert [lp.logprob for lp in mine.values()] == pytest.approx([lp.logprob for lp in other.values()], abs=1e-4)
    # sampled requests speculate too (rejection sampling, exact in distribution: tests/test_sampling.py); a seed
    # still gives the same text every time
    llm.engine.scheduler.speculative = SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": 1})  # more matches
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    proposed = llm.engine._counters.proposed_tokens
    first, second = (llm.generate(prompt, sampled, use_tqdm=False)[0].token_ids for _ in range(2))
    assert first == second and len(first) == NEW_TOKENS and llm.engine._counters.proposed_tokens > proposed
    llm.shutdown()
    plain.shutdown()


def test_a_one_token_last_chunk_forks_n_and_keeps_prompt_logprobs(tiny_llama):
    """The prompt's last chunk of one token looks like a decode; its token is the first output, where n > 1 forks
    and prompt logprobs end: it is sampled, not speculated (through an engine-core process as well)."""
    prompt = {"prompt_token_ids": repeating_prompts()[2][:33]}  # chunks of 16, 16, then 1
    settings = dict(dtype="float32", kv_cache_space=0.01, max_num_batched_tokens=16, max_num_seqs=4)
    plain = LLM(str(tiny_llama), **settings)
    params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    expected = plain.generate(prompt, params, use_tqdm=False)[0]
    plain.shutdown()
    for engine_process in (False, True):
        llm = LLM(str(tiny_llama), **settings, engine_process=engine_process,
                  speculative_config={**NGRAM, "prompt_lookup_min": 1})
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected.outputs]
        assert [list(e or {}) for e in out.prompt_logprobs] == [list(e or {}) for e in expected.prompt_logprobs]
        llm.shutdown()


def test_proposals_under_a_grammar_are_checked_against_it(tiny_llama):
    """A constrained request speculates: proposals the grammar refuses are cut before the step, and each row is
    masked as the grammar stands after the proposals before it; the output is the plain engine's."""
    regex = {"regex": "[a-z ]{10,30}\\.( [a-z ]{5,20}\\.){1,3}"}
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, structured_outputs=regex)
    prompts = [{"prompt_token_ids": p} for p in repeating_prompts()[:3]]
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01)
    expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01, speculative_config=NGRAM)
    llm.engine.scheduler.speculative = OracleProposer(llm.engine.speculative,
                                                      [p["prompt_token_ids"] for p in prompts], expected)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine._counters.accepted_tokens > 0
    llm.shutdown()


def test_smollm2_copying_a_text_accepts_most_proposals():
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_space=0.05, speculative_config=NGRAM)
    text = ("The paged KV cache stores keys and values in fixed-size blocks, so memory is allocated as sequences "
            "grow and almost none is wasted.")
    prompt = llm.apply_chat_template([{"role": "user", "content": f"Repeat this sentence exactly: {text}"}])
    params = SamplingParams(temperature=0, max_tokens=48)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    plain = LLM(dtype="float32", max_model_len=512, kv_cache_space=0.05)
    assert out.token_ids == plain.generate(prompt, params, use_tqdm=False)[0].token_ids
    counters = llm.engine._counters
    assert counters.accepted_tokens >= 0.5 * counters.proposed_tokens > 0
    assert counters.steps < len(out.token_ids)  # fewer forward passes than tokens
    llm.shutdown()
    plain.shutdown()


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama with a little noise on every weight, and its tokenizer: a draft whose proposals are right
    about half the time, so that every count of accepted tokens (0 to k) gets verified."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("noisy-draft")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(0.005 * torch.randn(weight.shape, generator=generator))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    return out


def draft_spec(path: Path, k: int = 4) -> dict:
    return {"model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("backend, block_size, blocks", [
    pytest.param("cpu", 16, 20, marks=pytest.mark.cpu_isa),
    pytest.param("openvino", 32, 10, marks=requires_openvino),
])
def test_draft_model_output_equals_transformers_with_caching_chunking_and_preemption(backend, block_size, blocks,
                                                                                   tiny_llama, noisy_draft,
                                                                                   monkeypatch, request):
    """The draft's cache shares the target's blocks: preempted, prefix-cached and rejected positions leave the
    target's output as transformers' greedy one."""
    if backend == "openvino":
        monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(request.getfixturevalue("openvino_export_dir")))
    prompts = repeating_prompts()
    expected = hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    # each block holds the target's and the draft's keys and values
    space = blocks * 2 * kv_bytes_per_block("llama", block_size=block_size) / 2**30
    llm = LLM(str(tiny_llama), backend=backend, dtype="float32", max_model_len=256, kv_cache_space=space,
              enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=8,
              speculative_config=draft_spec(noisy_draft))
    for _ in range(2):  # the second time from the prefix cache
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    counters = llm.engine._counters
    assert counters.proposed_tokens > counters.accepted_tokens > 0.2 * counters.proposed_tokens
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv_manager.prefix_cache.hits > 0
    assert llm.engine.kv_manager.allocator.num_used == 0
    llm.shutdown()


def test_the_target_as_its_own_draft_is_accepted_beside_n_sampling_grammars_and_logprobs(tiny_llama):
    """The verifier's check: a draft equal to the target proposes what the target then computes. Sampled,
    constrained and n > 1 requests speculate with it and give the plain engine's output."""
    settings = dict(dtype="float32", kv_cache_space=0.01, max_model_len=256)
    plain = LLM(str(tiny_llama), **settings)
    llm = LLM(str(tiny_llama), **settings, speculative_config=draft_spec(tiny_llama))
    prompts = [{"prompt_token_ids": p} for p in repeating_prompts()]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    counters = llm.engine._counters
    assert counters.accepted_tokens > 0.95 * counters.proposed_tokens > 0
    regex = {"regex": "[a-z ]{10,30}\\.( [a-z ]{5,20}\\.){1,3}"}
    for params in (SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0, max_tokens=NEW_TOKENS, structured_outputs=regex)):
        ours, theirs = (e.generate(prompts[:2], params, use_tqdm=False) for e in (llm, plain))
        assert [[c.token_ids for c in o.outputs] for o in ours] == [[c.token_ids for c in o.outputs] for o in theirs]
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    proposed = counters.proposed_tokens
    first, second = (llm.generate(prompts[0], sampled, use_tqdm=False)[0].token_ids for _ in range(2))
    assert first == second and len(first) == NEW_TOKENS and counters.proposed_tokens > proposed
    llm.shutdown()
    plain.shutdown()


def test_a_draft_model_of_another_vocabulary_or_with_tensor_parallelism_is_refused(tiny_llama, noisy_draft,
                                                                                   tmp_path):
    from transformers import AutoTokenizer

    other = tmp_path / "other-vocab"
    tokenizer = AutoTokenizer.from_pretrained(noisy_draft)
    tokenizer.add_tokens(["<extra>"])
    for f in noisy_draft.iterdir():
        if f.suffix in (".json", ".safetensors") and "token" not in f.name:
            (other / f.name).parent.mkdir(exist_ok=True)
            (other / f.name).write_bytes(f.read_bytes())
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match="must share the target's vocabulary"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01, speculative_config=draft_spec(other))
    with pytest.raises(ConfigError, match="tensor parallelism"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01, tensor_parallel_size=2,
            speculative_config=draft_spec(noisy_draft))


@pytest.mark.parametrize("spec, message", [
    ('{"method": "ngram"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "model": "some/draft", "num_speculative_tokens": 3}', "takes none"),
    ('{"method": "eagle", "model": "some/draft", "num_speculative_tokens": 3}', "not supported"),
    ('{"model": "some/draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}', "one rank"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "typo": 1}', "unknown key"),
    ("not json", "not a JSON object"),
])
def test_bad_speculative_configs_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(spec)


def test_the_proposer_continues_the_latest_earlier_match():
    config = SpeculativeConfig.parse(NGRAM)
    assert config.propose([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 4) == [8, 5, 1, 2]
    assert config.propose([1, 2, 3, 4], 4) == []
    assert config.propose([7, 7, 7], 2) == [7]  # what follows the match may run into the tail
