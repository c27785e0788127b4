"""Linear layers through oneDNN, their weights reordered once at load into its blocked layout (float32, and bfloat16
where the CPU has AVX-512).

nn.Linear goes to MKL's sgemm, which re-reads the plain [out, in] weight on every call; oneDNN (inside torch, the
same kernels OpenVINO uses) with the weight packed once is faster at decode sizes. The packed weight replaces the
plain one, so the weights are held once; a head tied to the embeddings keeps the embedding's copy and adds its
packed one. Sums in another order: equal to nn.Linear to fp32 rounding, not bit for bit. In bf16, nn.Linear reorders
the plain weight into oneDNN's layout on every call, which packing once saves.
"""

from __future__ import annotations

import torch

from pagedllm.backends import cpu_features

# oneDNN picks its blocking for this many rows; decode batches are where the packing pays.
_ROWS_HINT = 64


class PackedLinear(torch.nn.Module):
    """nn.Linear's forward over a oneDNN-packed weight (input and weight in the same dtype)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _ROWS_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # oneDNN takes the leading dimensions as rows itself: one op call, no reshape around it.
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN packs float32 weights on any x86 CPU, bfloat16 ones only with AVX-512 (its bf16 kernels need it)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return (cpu_features.rank(cpu_features.kernel_level()) >= cpu_features.rank("avx512")
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def use_packed_linears(model: torch.nn.Module) -> int:
    """Swap every plain nn.Linear of the model whose dtype oneDNN packs here for a PackedLinear; returns how many."""
    dtypes = {dtype for dtype in (torch.float32, torch.bfloat16) if can_pack(dtype)}
    names = [name for name, module in model.named_modules()
             if type(module) is torch.nn.Linear and module.weight.dtype in dtypes]
    for name in names:
        model.set_submodule(name, PackedLinear(model.get_submodule(name)))
    return len(names)
