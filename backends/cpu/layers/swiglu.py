"""Llama-family MLPs (SwiGLU) with silu(gate) * up as one C++ pass instead of torch's silu and multiply.

A module qualifies when its forward is Llama's MLP forward, bytecode for bytecode (Mistral, Qwen2 and Qwen3 copy
it), with SiLU as its activation.
"""

from __future__ import annotations

import torch

from pagedllm.backends.cpu.layers.module_swap import code_of, swap_forwards


def use_fused_swiglu(model: torch.nn.Module, kernels) -> int:
    """Give every qualifying MLP of the model the fused activation; returns how many."""
    if kernels is None:
        return 0
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP

    llama = code_of(LlamaMLP.forward)
    return swap_forwards(model, lambda module: code_of(type(module).forward) == llama
                         and isinstance(module.act_fn, (SiLUActivation, torch.nn.SiLU)),
                         lambda module: _fused_forward(module, kernels))


def _fused_forward(mlp: torch.nn.Module, kernels):
    def forward(x: torch.Tensor) -> torch.Tensor:
        # The projections are looked up per call: they may be swapped for packed ones after this.
        return mlp.down_proj(kernels.silu_and_mul(mlp.gate_proj(x), mlp.up_proj(x)))

    return forward
