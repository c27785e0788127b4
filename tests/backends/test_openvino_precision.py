"""Which inference and KV-cache precisions the openvino backend asks the CPU plugin for (pure logic)."""

import pytest

from pagedllm import ConfigError
from pagedllm.backends.openvino.precision import choose_precision

AVX2 = frozenset({"FP32", "INT8", "BIN", "EXPORT_IMPORT"})  # this machine
AMX = AVX2 | {"BF16"}


@pytest.mark.parametrize("dtype, kv, caps, expected", [
    ("float32", "auto", AMX, ("f32", "f32")),  # exact mode, whatever the CPU
    ("auto", "auto", AVX2, ("f32", "f16")),  # vLLM's default: f16 cache without native bf16...
    ("auto", "auto", AMX, ("bf16", "bf16")),  # ...bf16 with it
    ("bfloat16", "auto", AVX2, ("bf16", "f16")),
    ("float16", "auto", AMX, ("f16", "f16")),
    ("float32", "u8", AVX2, ("f32", "u8")),
    ("auto", "u8", AMX, ("bf16", "u8")),
    ("float32", "fp16", AVX2, ("f32", "f16")),
])
def test_choice(dtype, kv, caps, expected):
    precision = choose_precision(dtype, kv, caps)
    assert (precision.inference, precision.kv_cache) == expected
    assert precision.compile_properties() == {"INFERENCE_PRECISION_HINT": expected[0],
                                              "KV_CACHE_PRECISION": expected[1]}


@pytest.mark.parametrize("dtype, kv, caps, message", [
    ("auto", "bf16", AVX2, "bf16 KV cache needs a CPU with AVX512_BF16 or AMX"),
    ("bfloat16", "fp32", AMX, "fp32 KV cache needs float32 inference.*pass --dtype float32"),
])
def test_impossible_combinations_say_what_to_change(dtype, kv, caps, message):
    with pytest.raises(ConfigError, match=message):
        choose_precision(dtype, kv, caps)
