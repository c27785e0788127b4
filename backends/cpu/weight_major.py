"""Small-batch linear layers computed as ``weight @ x.T``.

With few rows (decode steps) MKL runs the [out, in] x [in, rows] product faster than nn.Linear's
``x @ weight.T`` once the weights come cold from memory, as they do in a model of 30 layers. Measured here (fp32,
2 threads, SmolLM2's layer shapes cycled over 30 layers): 64 rows 159 vs 197 ms per pass, 8 rows 71 vs 75; the LM
head alone 30 vs 41 ms at 64 rows. From ~256 rows on nn.Linear is as fast or faster (2048 rows: 3.4 vs 5.5 s), so
bigger inputs keep it. The product comes out as [out, rows]; turning it back into rows costs a transpose, which
the C++ kernels do ~4-8x faster than torch's strided copy (~16 ms of a 64-row decode step). The same sums in another
order: not bit-identical to nn.Linear, equal to fp32 rounding. Applied to float32 weights only: the bf16 GEMMs go
through other kernels and were not measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 128


def use_weight_major_linears(model: torch.nn.Module, kernels=None) -> None:
    """Give every plain float32 nn.Linear of the model the small-batch path."""
    transpose = kernels.transpose2d if kernels is not None else (lambda t: t.t().contiguous())
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            module.forward = _forward_of(module, transpose)


def _forward_of(linear: torch.nn.Linear, transpose):
    weight, bias = linear.weight, linear.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > MAX_ROWS:
            return F.linear(x, weight, bias)
        out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, flat.t())
        return transpose(out).view(*x.shape[:-1], weight.shape[0])

    return forward
