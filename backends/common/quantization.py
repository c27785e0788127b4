"""--quantization, one flag for both built-in backends (vLLM's name): each runs the formats it has and refuses the
others with what to use instead."""

from __future__ import annotations

from pagedllm.config import Setting

QUANTIZATION = Setting(
    "quantization", str, "auto",
    "weight quantization: auto = none; gguf = a GGUF file's quantized tensors as they are (cpu); "
    "q8_0, q4_0 = GGUF's block formats made at load (cpu); int8 = int8 weights (cpu: W8A8 with int8 activations; "
    "openvino: NNCF int8); int4 = 4-bit weights (openvino: NNCF int4, groups of 128; cpu: q4_0)",
    ("auto", "none", "gguf", "q8_0", "q4_0", "int8", "int4"), short_flag="-q")
