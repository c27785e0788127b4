"""Linear layers over block-quantized weights (quant_formats.QuantizedWeight), through csrc/quantized_linear.cpp.

A decode step's few rows go through the quantized kernel, which reads each weight once per step: batch-1 decode is
bound by the bytes of weights it reads. More rows (prompt chunks, large batches) are compute-bound: the weight is
dequantized for the call and goes through the dense GEMM, whose tiles the quantized kernel does not match.

Until the linears are swapped, a quantized weight rides on its nn.Linear (``attach``), whose dense weight becomes a
meta tensor, so that sharding and fusing carry it along without holding the dense weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.backends.cpu.layers.quant_formats import QuantizedWeight

QUANTIZED_WEIGHT = "quantized_weight"
# Up to this many rows the quantized kernel runs; above, the dequantized weight and the dense GEMM.
SMALL_ROWS = 16


def quantized_weight(linear: torch.nn.Module) -> QuantizedWeight | None:
    return getattr(linear, QUANTIZED_WEIGHT, None)


def attach(linear: torch.nn.Linear, weight: QuantizedWeight) -> None:
    """Give ``linear`` its quantized weight and drop its dense one (a meta tensor of the same shape and dtype)."""
    setattr(linear, QUANTIZED_WEIGHT, weight)
    dense = linear.weight
    linear.weight = torch.nn.Parameter(torch.empty(dense.shape, dtype=dense.dtype, device="meta"), requires_grad=False)


class QuantizedLinear(torch.nn.Module):
    """nn.Linear's forward over a QuantizedWeight. ``int8_activations`` (bf16 models) quantizes the rows to int8 per
    32 inputs for integer dot products; otherwise each weight is dequantized to float32 in the kernel (the exact
    path, for float32 models). With ``float_output`` it returns float32 (the LM head). ``kernel_only`` keeps every
    row count on the quantized kernel (batch invariance: the dense GEMM sums in another order)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels, int8_activations: bool,
                 kernel_only: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group, self.format = weight.bits, weight.group, weight.format
        self.register_buffer("values", weight.values)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("offsets", weight.offsets)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.int8_activations = int8_activations
        self.float_output = False
        self.kernel_only = kernel_only
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_only or x.numel() <= SMALL_ROWS * self.in_features:
            return self._kernels.quantized_linear(x, self.values, self.scales, self.offsets, self.bits, self.group,
                                                  self.bias, self.float_output, self.int8_activations)
        dense = self._kernels.dequantize_weight(self.values, self.scales, self.offsets, self.bits, self.group,
                                                x.dtype == torch.bfloat16)
        out = F.linear(x, dense, None if self.bias is None else self.bias.to(x.dtype))
        return out.float() if self.float_output else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"bits={self.bits}, group={self.group}, int8_activations={self.int8_activations}")
