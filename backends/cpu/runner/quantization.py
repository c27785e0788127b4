"""Which linear layers run on quantized weights, and where those come from (--quantization):

- ``gguf``: a GGUF file's quantized tensors as they are (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), as llama.cpp runs
  them;
- ``q8_0`` / ``q4_0``: float weights quantized at load into GGUF's block formats (the same kernels);
- ``int8``: symmetric per-output-row int8 weights with int8 activations (vLLM CPU's W8A8);
- ``none``: the dense weights (a GGUF file dequantized).

Called after the model loads and before it is sharded, fused and packed, which carry the quantized weights along.
A GGUF file's quantized tensors are loaded as they are by gguf_loading.py, without a dense model.
"""

from __future__ import annotations

import collections
import logging

import torch

from pagedllm.backends.common.memory import checkpoint_mappings, drop_checkpoint_pages
from pagedllm.backends.cpu.layers.quant_formats import quantize
from pagedllm.backends.cpu.layers.quantized_linear import attach
from pagedllm.backends.cpu.runner.sharding import LayerShards, Rank, use_head_slice, vocab_slice

logger = logging.getLogger("pagedllm.cpu")


def quantize_linears(model: torch.nn.Module, mode: str, dtype: torch.dtype | None = None,
                     rank: Rank | None = None, placeholders: bool = False) -> dict:
    """Attach quantized weights made at load (q8_0, q4_0, int8) to the model's linear layers; returns them by
    layer name (none for ``none``). Weights are quantized from ``dtype`` (the model's; a tensor-parallel rank's are
    still the files' tensors). A ``rank`` shards each decoder layer once it is quantized and quantizes only its
    vocabulary rows of the LM head, so that it never holds the whole quantized model. With ``placeholders``, only
    their layouts are made (QuantizedWeight.placeholder), for the panel cache to fill."""
    if mode == "none":
        return {}
    head = model.get_output_embeddings()
    linears = {name: module for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    layer_shards = LayerShards(model, rank) if rank is not None else None
    checkpoint = checkpoint_mappings()  # each weight read from the files gives its pages back once quantized
    weights = {}
    for name in list(linears):  # names only: a whole layer once sharded is referenced nowhere
        linear = linears[name]
        # the LM head is q8_0 for the block formats (llama.cpp keeps the output layer at higher precision); int8's
        # is int8 too, unlike vLLM's W8A8: in a batch's decode step the head weighs as much as several layers
        fmt = "q8_0" if linear is head and mode != "int8" else mode
        if not linear.in_features % 32:
            if linear is head and rank is not None:
                start, end, _ = vocab_slice(head.out_features, rank)
                rows = _quantized(head.weight[start:end], fmt, dtype, placeholders)
                name = name + ".linear"
                weights[name] = use_head_slice(model, rows, rank)
                linear = model.get_output_embeddings().linear
            else:
                weights[name] = _quantized(linear.weight, fmt, dtype, placeholders)
        if layer_shards is not None:
            for param_name, _ in linear.named_parameters():
                layer_shards.loaded(f"{name}.{param_name}", weights, linears)
        drop_checkpoint_pages(checkpoint)
    for name, weight in weights.items():
        if name in linears:  # not a layer LayerShards sharded (it attached theirs), nor the head's slice
            attach(linears[name], weight)
    return weights


def _quantized(weight: torch.Tensor, fmt: str, dtype: torch.dtype | None, placeholder: bool):
    if placeholder:  # one row tells the layout
        return quantize(weight[:1].to(dtype or weight.dtype), fmt).placeholder(weight.shape[0])
    return quantize(weight.to(dtype or weight.dtype), fmt)


def describe_quantized(model: torch.nn.Module, mode: str, weights: dict) -> str:
    """What the linear layers hold, for the log: their formats (their bytes are counted once packed)."""
    if mode == "none":
        return "linear layers: dense weights (--quantization none)"
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    formats = collections.Counter(weight.format for weight in weights.values())
    left = len(linears) - len(weights)
    return (f"linear layers: {len(weights)} quantized ({', '.join(f'{n} {f}' for f, n in sorted(formats.items()))})"
            + (f"; {left} dense" if left else ""))
