"""bf16 and u8 KV cache on SmolLM2: how often greedy tokens agree with float32, with floors from measurements.

Measured here (16 chat prompts x 32 greedy tokens, positional agreement with our float32 run, which equals
transformers float32 exactly): bf16 0.78 (transformers' own bf16 vs its float32: 0.73); float32 weights with a u8
KV cache 0.91; a bf16 KV cache 0.998. Divergence is a cascade: after the first differing token the rest differ too.
"""

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = ["Tell me about Paris", "Write a haiku about the sea.", "What is 12 times 13?",
           "Explain photosynthesis briefly.", "List three uses of copper.", "Who wrote Hamlet?",
           "Give me a recipe for pancakes.", "Why is the sky blue?", "What is the capital of Japan?",
           "Describe a cat in one sentence.", "How do airplanes fly?", "Name a prime number above 50.",
           "What does a compiler do?", "Suggest a name for a bakery.", "Translate 'good morning' to French.",
           "What is gravity?"]
NEW_TOKENS = 32


def greedy(generate=True, **engine_args):
    llm = LLM(max_model_len=1024, kv_cache_space=0.25, **engine_args)
    if not generate:
        blocks = llm.engine.num_blocks
        llm.shutdown()
        return None, blocks
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    blocks = llm.engine.num_blocks
    llm.shutdown()
    return [o.token_ids for o in outs], blocks


def agreement(ref, got):
    return sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g)) / (NEW_TOKENS * len(ref))


@pytest.fixture(scope="module")
def float32_run():
    return greedy(dtype="float32")


def test_bf16_agrees_with_float32_on_most_tokens(float32_run):
    ref, _ = float32_run
    got, _ = greedy(dtype="bfloat16")
    assert agreement(ref, got) >= 0.70


def test_u8_kv_cache_agrees_and_holds_1_8x_the_blocks_of_bf16(float32_run):
    ref, fp32_blocks = float32_run
    got, u8_blocks = greedy(dtype="float32", kv_cache_dtype="u8")
    assert agreement(ref, got) >= 0.85
    _, bf16_blocks = greedy(generate=False, dtype="float32", kv_cache_dtype="bf16")
    assert bf16_blocks == pytest.approx(2 * fp32_blocks, abs=1)
    assert 1.7 <= u8_blocks / bf16_blocks <= 1.9  # head size 64: 128 bytes per token and head vs 64 + 8
