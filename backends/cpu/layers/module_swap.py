"""Giving module instances a fused forward where their class's forward is a known one, bytecode for bytecode.

The C++ kernels take over layers whose code is exactly transformers' Llama code (other families copy it); a
module whose forward differs in any way keeps its own.
"""

from __future__ import annotations

from typing import Callable

import torch


def code_of(function) -> tuple:
    code = getattr(function, "__code__", None)
    return (code.co_code, code.co_names, code.co_consts) if code is not None else ()


# Set on the parts of a decoder layer whose forward runs them as one (fused_layers): their own forwards never run.
INSIDE_FUSED_LAYER = "_pagedllm_inside_fused_layer"


def swap_forwards(model: torch.nn.Module, qualifies: Callable[[torch.nn.Module], bool],
                  fused_forward: Callable[[torch.nn.Module], Callable]) -> int:
    """Set ``module.forward = fused_forward(module)`` on every module that qualifies; returns how many."""
    swapped = 0
    for module in model.modules():
        if not getattr(module, INSIDE_FUSED_LAYER, False) and qualifies(module):
            module.forward = fused_forward(module)
            swapped += 1
    return swapped
