"""bf16 and u8 KV cache on SmolLM2: how often their top token agrees with float32's, with floors from measurements.

Agreement is teacher-forced: at each step of float32's own greedy continuation (16 chat prompts x 32 tokens; our
float32 equals transformers exactly), does the other precision pick the same token given the same tokens before
it. Free-running agreement (each run continuing its own output) cascades from the first differing token, so it
swings with thread counts and ISA from run to run; this measure does not. Floors sit under the lowest of the
measurements on both kinds of CPU, recorded in docs/precision.md.
"""

import numpy as np
import pytest
from equality_support import teacher_forced_top1

from pagedllm import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.cpu_isa]  # bf16 rounding follows the ISA (AVX2, AVX512_BF16, AMX)
PROMPTS = ["Tell me about Paris", "Write a haiku about the sea.", "What is 12 times 13?",
           "Explain photosynthesis briefly.", "List three uses of copper.", "Who wrote Hamlet?",
           "Give me a recipe for pancakes.", "Why is the sky blue?", "What is the capital of Japan?",
           "Describe a cat in one sentence.", "How do airplanes fly?", "Name a prime number above 50.",
           "What does a compiler do?", "Suggest a name for a bakery.", "Translate 'good morning' to French.",
           "What is gravity?"]
NEW_TOKENS = 32
BF16_FLOOR = 0.95
U8_FLOOR = 0.98


def make_llm(**engine_args) -> LLM:
    return LLM(max_model_len=1024, kv_cache_space=0.25, **engine_args)


@pytest.fixture(scope="module")
def float32_run():
    """(prompts as token ids, float32's greedy continuations, its KV blocks)."""
    llm = make_llm(dtype="float32")
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}])["prompt_token_ids"] for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    blocks = llm.engine.num_blocks
    llm.shutdown()
    return prompts, [o.outputs[0].token_ids for o in outs], blocks


def agreement(llm: LLM, prompts, continuations) -> float:
    picked = [teacher_forced_top1(llm, p, c) == np.array(c) for p, c in zip(prompts, continuations)]
    llm.shutdown()
    return float(np.mean(np.concatenate(picked)))


def test_bf16_agrees_with_float32(float32_run):
    prompts, continuations, _ = float32_run
    assert agreement(make_llm(dtype="bfloat16"), prompts, continuations) >= BF16_FLOOR


def test_its_own_q4_1_blocks_in_bf16_agree_with_float32(float32_run):
    """--quantization gguf under bf16 (the default model's default): the file's Q4_1 and Q8_0 blocks dequantized to
    bf16 for the dot products."""
    prompts, continuations, _ = float32_run
    assert agreement(make_llm(dtype="bfloat16", quantization="gguf"), prompts, continuations) >= BF16_FLOOR


def test_u8_kv_cache_agrees_and_holds_1_5x_the_blocks_of_bf16(float32_run):
    prompts, continuations, fp32_blocks = float32_run
    u8 = make_llm(dtype="float32", kv_cache_dtype="u8")
    u8_blocks = u8.engine.num_blocks
    assert agreement(u8, prompts, continuations) >= U8_FLOOR
    bf16 = make_llm(dtype="float32", kv_cache_dtype="bf16")
    bf16_blocks = bf16.engine.num_blocks
    bf16.shutdown()
    assert bf16_blocks == pytest.approx(2 * fp32_blocks, abs=1)
    # head size 64, blocks of 16: per token and head 2 x 128 bytes against keys of 64 bytes plus a float32 scale and
    # minimum per channel and block (96) and values of 64 bytes plus a scale and minimum (72)
    assert 1.5 <= u8_blocks / bf16_blocks <= 1.55
