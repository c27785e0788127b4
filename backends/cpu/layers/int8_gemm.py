"""W8A8 linear layers (``--quantization int8`` on a bf16 model): int8 weights per output row and int8 activations per
row, multiplied by oneDNN's int8 GEMM inside torch (AMX-INT8 or VNNI), as vLLM CPU's W8A8.

Integer products run at twice bf16's rate on these matrix units, so batches and prompts, which are compute-bound,
gain where the bf16 tiles of the block formats cannot. The int32 sums are exact, so a row's result does not depend
on the rows beside it. The weight is held once, in oneDNN's packed layout; decode steps take the same GEMM.
"""

from __future__ import annotations

import torch

from pagedllm.backends.common import cpu_features
from pagedllm.backends.cpu.layers.quant_formats import QuantizedWeight, unpack_values

INT8_FORMAT = "int8"


def int8_gemm_available() -> bool:
    """Whether torch has oneDNN's quantized linear (x86 builds with oneDNN)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "onednn")
            and hasattr(torch.ops.onednn, "qlinear_prepack"))


def exact_int8_products() -> bool:
    """Whether oneDNN's int8 GEMM sums exactly here: it needs VNNI's dot products. Without them (AVX2 alone) it
    multiplies u8 by s8 with vpmaddubsw, whose 16-bit pair sums saturate, and outputs can be far off."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_features.cpu_flags())


def takes_int8_gemm(weight: QuantizedWeight, bf16: bool, kernels) -> bool:
    """W8A8 through oneDNN for ``int8`` weights of a bf16 model on a CPU with VNNI; float32 models (and CPUs without
    VNNI) keep the panels' kernels, whose integer sums are exact."""
    return (weight.format == INT8_FORMAT and bf16 and kernels is not None
            and hasattr(kernels, "quantize_rows_uint8") and int8_gemm_available() and exact_int8_products())


def signed_int8(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``int8`` weight as (int8 values [out, in], float32 scale per output row): quantize() keeps the values offset
    by 128 and the row's scale repeated per block of 32 inputs."""
    values = (unpack_values(weight.values, 8).to(torch.int16) - 128).to(torch.int8)
    return values, weight.scales[:, 0].float().contiguous()


class Int8GemmLinear(torch.nn.Module):
    """nn.Linear's forward as x ~ s * q per row (int8 q, float32 s), then s * (q @ W_int8.T) * w_scale + bias.

    q goes to oneDNN as uint8 with zero point 128: its AVX512_VNNI kernels take unsigned activations only (vpdpbusd),
    and signed ones fall to its reference kernel. AMX takes either."""

    ACTIVATION_ZERO_POINT = 128

    path = "int8 GEMM"
    is_quantized = True

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.format = weight.format
        values, scales = signed_int8(weight)
        # a placeholder's (runner/panel_cache.py) come with restore_state
        self.packed = None if values.is_meta else torch.ops.onednn.qlinear_prepack(values, None)
        self.register_buffer("weight_scales", scales)
        self.register_buffer("weight_zero_points", torch.zeros(self.out_features, dtype=torch.long))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.nbytes = values.numel() + self.weight_scales.nbytes
        self.float_output = False
        self._kernels = kernels

    def cache_layout(self) -> dict:
        """What a placeholder of this layer knows already (runner/panel_cache.py checks it against an entry)."""
        return {"format": self.format, "out_features": self.out_features, "in_features": self.in_features}

    def cache_state(self) -> tuple[dict, dict]:
        """(tensors, other values) that make this layer: the int8 values out of oneDNN's packed layout (which
        depends on the CPU), [in, out] there."""
        return {"values": self.packed.to_dense().t(), "weight_scales": self.weight_scales}, {}

    def restore_state(self, tensors: dict, values: dict) -> None:
        """Take the int8 values and scales of a cache entry (this layer built from a placeholder), packed here."""
        if tensors["values"].shape != (self.out_features, self.in_features):
            raise ValueError(f"values of {tuple(tensors['values'].shape)}")
        self.packed = torch.ops.onednn.qlinear_prepack(tensors["values"], None)
        self.weight_scales = tensors["weight_scales"]

    def unscaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q @ W_int8.T * w_scale as [rows, out], the rows' scales s): the output is s times the first."""
        q, row_scales = self._kernels.quantize_rows_uint8(x)
        out = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, self.ACTIVATION_ZERO_POINT, self.packed, self.weight_scales, self.weight_zero_points, None, 1.0, 0,
            torch.float32 if self.float_output else x.dtype, "none", [None], "")
        return out, row_scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, row_scales = self.unscaled(x)
        self._kernels.scale_rows(out, row_scales, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, path=oneDNN"


class Int8GemmSiluAndMul(Int8GemmLinear):
    """A SwiGLU's [gate; up] W8A8 projection returning silu(gate) * up, the rows' scales applied in the SiLU's pass
    (the widest output of the layer is not read and written once more for them)."""

    fuses_silu_and_mul = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.out_features // 2
        if self.bias is not None:
            both, row_scales = super().forward(x).reshape(-1, self.out_features), None
        else:
            both, row_scales = self.unscaled(x)
        out = self._kernels.silu_and_mul(both[:, :width], both[:, width:], row_scales)
        return out.reshape(*x.shape[:-1], width)
