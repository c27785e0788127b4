"""Batch-invariant mode: a request's logits (seen through the logprobs of every token it samples) are bitwise the
same alone, beside 1 to 63 other requests, cut into chunks, over a prefix-cached prompt and under speculative
decoding, in float32 on every CPU kind and in bf16 where the CPU has it (SmolLM2 too, dense and on its GGUF
quantized tensors); the openvino backend refuses the mode. Without the mode the chunked cases differ already on the
tiny models, and SmolLM2 differs in a batch."""

from __future__ import annotations

import pytest
from openvino_support import requires_openvino
from tiny_models import random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.backends.common import cpu_features
from pagedllm.errors import ConfigError

NEW_TOKENS = 24
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
TARGET = random_prompts([40], seed=11)[0] * 2  # repeats itself, so the n-gram proposer finds matches


def fingerprint(output) -> list[tuple]:
    """The sampled tokens and every logprob the request got, as exact floats."""
    completion = output.outputs[0]
    return [(token, tuple(sorted((t, lp.logprob) for t, lp in entry.items())))
            for token, entry in zip(completion.token_ids, completion.logprobs)]


def target_alone(llm: LLM) -> list[tuple]:
    return fingerprint(llm.generate([TARGET], PARAMS, use_tqdm=False)[0])


def target_among(llm: LLM, others: int, seed: int) -> list[tuple]:
    """The target in the middle of ``others`` random prompts of mixed lengths and output lengths."""
    rng_prompts = random_prompts([3 + (7 * i) % 90 for i in range(others)], seed=seed)
    params = [SamplingParams(temperature=0, max_tokens=1 + (5 * i) % 30, ignore_eos=True) for i in range(others)]
    half = others // 2
    prompts = rng_prompts[:half] + [TARGET] + rng_prompts[half:]
    outputs = llm.generate(prompts, params[:half] + [PARAMS] + params[half:], use_tqdm=False)
    return fingerprint(outputs[half])


DTYPES = [pytest.param("float32", marks=pytest.mark.cpu_isa),
          pytest.param("bfloat16", marks=pytest.mark.skipif(not cpu_features.has_native_bf16(),
                                                             reason="bf16 needs AVX512_BF16 or AMX here"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_bitwise_equal_alone_in_batches_chunked_cached_and_speculated(arch, dtype, tiny_model_dirs):
    model = str(tiny_model_dirs[arch])
    plain = LLM(model, dtype=dtype, batch_invariant=True, enable_prefix_caching=False, max_num_batched_tokens=2048)
    alone = target_alone(plain)
    for others, seed in [(1, 1), (7, 2), (63, 3)]:
        assert target_among(plain, others, seed) == alone, f"beside {others} other requests"
    # Chunks of 16 tokens under a 24-token budget (so decodes share steps with other prompts' chunks), the prompt
    # cached by the first run for the second, and n-gram proposals verified as extra query rows.
    busy = LLM(model, dtype=dtype, batch_invariant=True, enable_prefix_caching=True, max_num_batched_tokens=24,
               max_num_seqs=8, speculative_config=NGRAM)
    assert target_alone(busy) == alone, "chunked and speculated"
    assert target_alone(busy) == alone, "over the cached prompt"
    assert target_among(busy, 3, 4) == alone, "chunked beside others, speculated"


@pytest.mark.slow
@pytest.mark.skipif(not cpu_features.has_native_bf16(), reason="bf16 needs AVX512_BF16 or AMX here")
def test_smollm2_bf16_logits_bitwise_equal_alone_in_a_batch_and_chunked():
    llm = LLM(dtype="bfloat16", batch_invariant=True, enable_prefix_caching=False, max_model_len=1024,
              kv_cache_space=0.25)
    alone = target_alone(llm)
    assert target_among(llm, 9, 5) == alone
    llm.shutdown()
    quantized = LLM(dtype="bfloat16", batch_invariant=True, quantization="gguf", enable_prefix_caching=False,
                    max_model_len=1024, kv_cache_space=0.25)  # the file's own Q4_1/Q8_0 tensors, int8 activations
    assert target_among(quantized, 9, 5) == target_alone(quantized)
    quantized.shutdown()
    chunked = LLM(dtype="bfloat16", batch_invariant=True, max_num_batched_tokens=32, max_num_seqs=4,
                  max_model_len=1024, kv_cache_space=0.25, speculative_config=NGRAM)
    assert target_alone(chunked) == alone


@requires_openvino
def test_openvino_refuses_batch_invariance(tiny_model_dirs, openvino_export_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(openvino_export_dir))
    with pytest.raises(ConfigError, match="not available on the openvino backend"):
        LLM(str(tiny_model_dirs["llama"]), backend="openvino", batch_invariant=True)
