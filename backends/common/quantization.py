"""--quantization, one flag for both built-in backends (vLLM's name): each runs the formats it has and refuses the
others with what to use instead."""

from __future__ import annotations

from pagedllm.config import Setting

QUANTIZATION = Setting(
    "quantization", str, "auto",
    "weight quantization: auto = a GGUF file's quantized tensors on the cpu backend (where its C++ kernels run), "
    "else none; gguf = a GGUF file's quantized tensors as they are (cpu); "
    "q8_0, q4_0 = GGUF's block formats made at load (cpu); int8 = int8 weights (cpu: W8A8, int8 activations per "
    "row through oneDNN's int8 GEMM in bf16; openvino: NNCF int8); int4 = 4-bit weights (openvino: NNCF int4, "
    "groups of 128; cpu: q4_0)",
    ("auto", "none", "gguf", "q8_0", "q4_0", "int8", "int4"), short_flag="-q")

INT8_ACTIVATIONS = Setting(
    "int8_activations", bool, False,
    "cpu, quantized weights: quantize a decode step's activations (up to 4 rows in bf16, 16 in float32) to int8 per "
    "32 inputs and take integer dot products, as llama.cpp (faster batch-1 decode, less agreement with float32, "
    "whose models take int16 ones otherwise; see docs/quantization.md); --quantization int8 in bf16 quantizes every "
    "call's activations per row instead (W8A8)")
