"""Which linear layers run on quantized weights, and where those come from (--quantization):

- ``gguf``: a GGUF file's quantized tensors as they are (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), as llama.cpp runs
  them;
- ``q8_0`` / ``q4_0``: float weights quantized at load into GGUF's block formats (the same kernels);
- ``int8``: symmetric per-output-row int8 weights with int8 activations (vLLM CPU's W8A8);
- ``none`` (and ``auto``, for now): the dense weights (a GGUF file dequantized).

Called after the model loads and before it is sharded, fused and packed, which carry the quantized weights along.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import numpy as np
import torch

from pagedllm.backends.cpu.layers.quant_formats import GGUF_FORMATS, from_gguf, quantize
from pagedllm.backends.cpu.layers.quantized_linear import attach
from pagedllm.errors import UnsupportedModelError

logger = logging.getLogger("pagedllm.cpu")


def quantize_linears(model: torch.nn.Module, mode: str, gguf_file: Path | None) -> str:
    """Attach quantized weights to the model's linear layers for ``mode`` (resolved); returns what was done, for the
    log."""
    if mode == "none":
        return "linear layers: dense weights (--quantization none)"
    linears = {name: module for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    if mode == "gguf":
        weights = _gguf_weights(model, linears, gguf_file)
    else:
        weights = _quantized_at_load(model, linears, mode)
    element = next(iter(model.parameters())).element_size()
    dense_bytes = sum(linears[name].weight.numel() * element for name in weights)
    for name, weight in weights.items():
        attach(linears[name], weight)
    formats = collections.Counter(weight.format for weight in weights.values())
    quantized_bytes = sum(weight.nbytes for weight in weights.values())
    left = len(linears) - len(weights)
    return (f"linear layers: {len(weights)} quantized ({', '.join(f'{n} {f}' for f, n in sorted(formats.items()))}), "
            f"{quantized_bytes / 2**20:.0f} MiB instead of {dense_bytes / 2**20:.0f} MiB dense"
            + (f"; {left} dense" if left else ""))


def _quantized_at_load(model: torch.nn.Module, linears: dict, mode: str) -> dict:
    """The decoder's linears in ``mode``; the LM head stays dense for int8 (as vLLM's W8A8) and is q8_0 for the
    block formats (as llama.cpp keeps the output layer at higher precision)."""
    head = model.get_output_embeddings()
    weights = {}
    for name, linear in linears.items():
        fmt = ("q8_0" if mode != "int8" else None) if linear is head else mode
        if fmt is None or linear.in_features % 32:
            continue
        weights[name] = quantize(linear.weight, fmt)
    return weights


def _gguf_weights(model: torch.nn.Module, linears: dict, gguf_file: Path) -> dict:
    """The GGUF file's quantized tensors for the model's linears, rows in the Hugging Face order (transformers'
    tensor processor permutes Llama's q and k rows; the same permutation applies to whole quantized rows)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = GGUFReader(str(gguf_file))
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    text = model.config.get_text_config()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config={
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads})
    to_hf = get_gguf_hf_weights_map(model, processor)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    head_name = next((name for name, linear in linears.items() if linear is head), None)
    weights, skipped = {}, collections.Counter()
    for tensor in reader.tensors:
        names = [to_hf.get(tensor.name, "")]
        if tied and names[0].endswith("embed_tokens.weight"):
            names = [head_name]  # a tied head scores with the embedding's quantized rows
        for hf_name in names:
            module = hf_name.removesuffix(".weight") if hf_name else None
            linear = linears.get(module)
            if linear is None:
                continue
            type_name = tensor.tensor_type.name
            if type_name not in GGUF_FORMATS:
                skipped[type_name] += 1
                continue
            rows, columns = int(tensor.shape[-1]), int(tensor.shape[0])
            if (rows, columns) != (linear.out_features, linear.in_features):
                skipped[f"{type_name} of an unexpected shape"] += 1
                continue
            try:
                weight = from_gguf(np.asarray(tensor.data), type_name, rows, columns)
            except ValueError as exc:
                raise UnsupportedModelError(f"{gguf_file}: tensor {tensor.name}: {exc}") from exc
            order = processor.process(np.arange(rows).reshape(rows, 1), tensor.name).weights.reshape(rows)
            if not np.array_equal(order, np.arange(rows)):
                weight = weight.rows(torch.from_numpy(np.ascontiguousarray(order)))
            weights[module] = weight
    if skipped:
        logger.info("GGUF tensors left dense (no quantized kernel for them): %s",
                    ", ".join(f"{n} {kind}" for kind, n in sorted(skipped.items())))
    return weights
