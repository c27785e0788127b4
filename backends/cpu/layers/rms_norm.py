"""Llama-family RMSNorm layers run as one C++ call per layer instead of seven torch ops.

A module qualifies when its forward is Llama's RMSNorm forward, bytecode for bytecode (Mistral, Qwen2, Qwen3 and
Phi-3 copy it; Gemma's differs and keeps its own). The fused kernel computes the same float32 expression; only the
order of the sum of squares differs, so results agree to float32 rounding.
"""

from __future__ import annotations

import torch

from pagedllm.backends.cpu.layers.module_swap import code_of, swap_forwards


def use_fused_rms_norms(model: torch.nn.Module, kernels) -> int:
    """Give every qualifying norm layer of the model the fused kernel; returns how many."""
    if kernels is None:
        return 0
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    llama = code_of(LlamaRMSNorm.forward)
    return swap_forwards(model, lambda module: code_of(type(module).forward) == llama
                         and getattr(module, "weight", None) is not None
                         and module.weight.dtype in (torch.float32, torch.bfloat16),
                         lambda module: _fused_forward(module, kernels))


def _fused_forward(norm: torch.nn.Module, kernels):
    weight, eps, unfused = norm.weight, float(norm.variance_epsilon), norm.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        # A float32 residual stream under bf16 weights (fused_layers) is normed into the weight's dtype.
        if hidden_states.dtype not in (weight.dtype, torch.float32) or not hidden_states.is_contiguous():
            return unfused(hidden_states)
        return kernels.rms_norm(hidden_states, weight, eps)

    return forward
