"""Float32 linear layers through oneDNN, their weights reordered once at load into its blocked layout.

nn.Linear goes to MKL's sgemm, which re-reads the plain [out, in] weight on every call; oneDNN (inside torch, the
same kernels OpenVINO uses) with the weight packed once is faster at decode sizes. The packed weight replaces the
plain one, so the weights are held once; a head tied to the embeddings keeps the embedding's copy and adds its
packed one. Sums in another order: equal to nn.Linear to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch

# oneDNN picks its blocking for this many rows; decode batches are where the packing pays.
_ROWS_HINT = 64


class PackedLinear(torch.nn.Module):
    """nn.Linear's forward over a oneDNN-packed float32 weight."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _ROWS_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def use_packed_linears(model: torch.nn.Module) -> int:
    """Swap every plain float32 nn.Linear of the model for a PackedLinear; returns how many were swapped."""
    if not can_pack():
        return 0
    names = [name for name, module in model.named_modules()
             if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32]
    for name in names:
        model.set_submodule(name, PackedLinear(model.get_submodule(name)))
    return len(names)
