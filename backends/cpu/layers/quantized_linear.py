"""Linear layers over block-quantized weights (quant_formats.QuantizedWeight), through csrc/quantized_linear.cpp.

A decode step's few rows go through a streaming kernel, which reads each weight once per step: batch-1 decode is
bound by the bytes of weights it reads. More rows (prompt chunks, large batches) are compute-bound: the weight is
dequantized a block at a time to bf16 tiles for brgemm (bf16 models) or to float32 blocks for register tiles and
MKL's GEMM (float32 models, csrc/quantized_linear_f32.cpp).

Until the linears are swapped, a quantized weight rides on its nn.Linear (``attach``), whose dense weight becomes a
meta tensor, so that sharding and fusing carry it along without holding the dense weights.
"""

from __future__ import annotations

import torch

from pagedllm.backends.cpu.layers.quant_formats import PANEL, QuantizedWeight, to_panels

QUANTIZED_WEIGHT = "quantized_weight"
PANEL_TENSORS = ("values", "scales", "offsets", "multipliers")
# float32 models: up to this many rows the streaming kernel runs; above, float32 blocks for the GEMM.
SMALL_ROWS = 16
# bf16 models: up to this many rows (by bits per value) each panel's values are dotted with every row as they stream
# by (a decode step's few rows); above, bf16 tiles for brgemm, whose matrix units win from there on (see
# benchmarks/quantized_linear.py; 8-bit values take twice the dot products, 5-bit and 6-bit ones as many as 4-bit
# ones). The int8 path runs up to 4 rows.
GEMV_ROWS = {4: 4, 5: 4, 6: 4, 8: 2}
INT8_ROWS = 4


def quantized_weight(linear: torch.nn.Module) -> QuantizedWeight | None:
    return getattr(linear, QUANTIZED_WEIGHT, None)


def attach(linear: torch.nn.Linear, weight: QuantizedWeight) -> None:
    """Give ``linear`` its quantized weight and drop its dense one (a meta tensor of the same shape and dtype)."""
    setattr(linear, QUANTIZED_WEIGHT, weight)
    dense = linear.weight
    linear.weight = torch.nn.Parameter(torch.empty(dense.shape, dtype=dense.dtype, device="meta"), requires_grad=False)


def quantized_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """The bytes the model's quantized linears hold (values, scales and offsets), and what they would as dense
    weights of the model's dtype."""
    quantized = [m for m in model.modules() if getattr(m, "is_quantized", False)]
    element = torch.finfo(model.dtype).bits // 8
    return sum(m.nbytes for m in quantized), sum(m.in_features * m.out_features * element for m in quantized)


def quantized_path(model: torch.nn.Module) -> str:
    """How the model's quantized linears take their dot products (one way for all of them)."""
    return next(module.path for module in model.modules() if getattr(module, "is_quantized", False))


class QuantizedLinear(torch.nn.Module):
    """nn.Linear's forward over a QuantizedWeight, held in panels of 16 columns (quant_formats.to_panels). bf16
    models dot the values with their bf16 activations as they stream by for a decode step's few rows (``few_rows``),
    weights unrounded, and dequantize them to bf16 tiles for brgemm above, so their activations stay bf16 as in the
    dense model; with ``int8_activations`` they quantize the activations to int8 per 32 inputs for the few rows
    instead and take integer dot products (as llama.cpp: faster, less precise). float32 models quantize their
    activations to int16 per 32 inputs up to SMALL_ROWS rows (integer dot products, the activations rounded to 1
    part in 65534 of each chunk's largest), and dequantize a block of 64 columns at a time to float32 for the GEMM
    above. With ``float_output`` it returns float32 (the LM head). ``kernel_only`` keeps every row count on one
    kernel (batch invariance: each path sums in its own order)."""

    is_quantized = True  # quantized_bytes and quantized_path look for it (as on int8_gemm.Int8GemmLinear)

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels, bf16: bool,
                 int8_activations: bool = False, kernel_only: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group, self.format = weight.bits, weight.group, weight.format
        panels = to_panels(weight)
        self.zero = panels.zero
        self.register_buffer("values", panels.values)
        self.register_buffer("scales", panels.scales)
        self.register_buffer("offsets", panels.offsets)
        self.register_buffer("multipliers", panels.multipliers)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.bf16_kernels = bf16 and kernels.quantized_linear_bf16_available()
        # without the bf16 kernels, int8 activations are a bf16 model's only quantized kernel for a few rows
        self.int8_activations = int8_activations or (bf16 and not self.bf16_kernels)
        # the streaming kernel's activations: float32 models take int16 ones (nearly float32, at twice the rate of
        # float32 products; docs/quantization.md)
        self.activation_bits = 8 if self.int8_activations else 16
        # bf16 models: rows up to this many take the streaming kernel, more the bf16 tiles
        self.few_rows = INT8_ROWS if self.int8_activations else GEMV_ROWS[self.bits]
        self.float_output = False
        self.kernel_only = kernel_only
        self._kernels = kernels

    @property
    def nbytes(self) -> int:
        """The bytes its weight holds (as PanelWeight.nbytes)."""
        return sum(getattr(self, name).nbytes for name in PANEL_TENSORS)

    def cache_layout(self) -> dict:
        """What a placeholder of this layer knows already (runner/panel_cache.py checks it against an entry)."""
        return {"format": self.format, "out_features": self.out_features, "in_features": self.in_features,
                "bits": self.bits, "group": self.group}

    def cache_state(self) -> tuple[dict, dict]:
        """(tensors, other values) that make this layer, for the panel cache to keep."""
        return {name: getattr(self, name) for name in PANEL_TENSORS}, {"zero": self.zero}

    def restore_state(self, tensors: dict, values: dict) -> None:
        """Take the panels of a cache entry (this layer built from a placeholder)."""
        if tensors["values"].shape != self.values.shape:
            raise ValueError(f"values of {tuple(tensors['values'].shape)}, not {tuple(self.values.shape)}")
        for name in PANEL_TENSORS:
            setattr(self, name, tensors[name])
        self.zero = values["zero"]

    @property
    def path(self) -> str:
        """How it takes its dot products, for the log (one of model_runner.QUANTIZED_PATHS)."""
        if self.bf16_kernels:
            return "int8 and bf16 tiles" if self.int8_activations else "bf16"
        return "int8" if self.int8_activations else "int16"

    def kernel_weight(self) -> tuple:
        """(values, scales, offsets, multipliers, bits, group, zero, out_features, bias): the kernels' weight
        arguments, kept once made: looking the buffers up through Module.__getattr__ costs a few microseconds on every
        call of a decode step's small linears."""
        made = self.__dict__.get("_kernel_weight")
        if made is None:
            made = self.__dict__["_kernel_weight"] = (self.values, self.scales, self.offsets, self.multipliers,
                                                      self.bits, self.group, self.zero, self.out_features, self.bias)
        return made

    @property
    def arguments(self) -> tuple:
        """The weight's first arguments of the kernels that take the column count (quant_formats.PanelWeight's)."""
        return self.kernel_weight()[:-1]

    def __setattr__(self, name: str, value) -> None:
        self.__dict__.pop("_kernel_weight", None)  # a buffer may be replaced: made again on next use
        super().__setattr__(name, value)

    def _apply(self, fn, recurse: bool = True):
        self.__dict__.pop("_kernel_weight", None)  # .to(), .float() and the like give the buffers new tensors
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        weight = self.kernel_weight()
        if self.bf16_kernels:
            if self.kernel_only or rows > self.few_rows:
                return self._kernels.quantized_linear_bf16(x, *weight, self.float_output)
            if not self.int8_activations:
                return self._kernels.quantized_gemv_bf16(x, *weight, self.float_output)
        if self.kernel_only or rows <= SMALL_ROWS:
            return self._kernels.quantized_linear(x, *weight, self.float_output, self.activation_bits)
        return self._kernels.quantized_linear_tiles_f32(x, *weight, self.float_output)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"bits={self.bits}, group={self.group}, path={self.path}")


class QuantizedSiluAndMul(QuantizedLinear):
    """A SwiGLU's quantized gate and up projections ([gate; up] rows) returning silu(gate) * up: in bf16 tiles the
    two are combined in the GEMM's epilogue, as BrgemmSiluAndMul does over dense weights, where each half is whole
    panels; a few rows take the unfused product and the SiLU kernel."""

    fuses_silu_and_mul = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.width = self.out_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.bf16_kernels and (self.kernel_only or rows > self.few_rows) and self.width % PANEL == 0:
            return self._kernels.quantized_linear_silu_and_mul_bf16(
                x, *self.arguments[:7], self.bias, self.width)
        both = super().forward(x)
        return self._kernels.silu_and_mul(both[..., :self.width], both[..., self.width:])
