"""The token embedding of a GGUF model whose LM head is tied to it, looked up in the head's quantized panels.

The dense table is the vocabulary times the hidden size (half a GB in bf16 for a Llama-3 vocabulary), more than the
whole quantized head, and a step reads only its tokens' rows: those are dequantized per call instead, to the same
values the dense table held (csrc/quantized_linear.cpp's dequantize_rows).
"""

from __future__ import annotations

import torch

from pagedllm.backends.cpu.layers.quantized_linear import QuantizedLinear


class HeadPanelEmbedding(torch.nn.Module):
    """nn.Embedding's forward over a QuantizedLinear head's weight (same rows: tied)."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype, kernels) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self._weight = head.arguments  # the head's tensors, not registered again: its module holds them
        self.bf16 = dtype == torch.bfloat16
        self._kernels = kernels

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self._kernels.dequantize_rows(*self._weight, input_ids.reshape(-1), self.bf16)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows from the tied head's quantized panels"


def embed_from_head(model: torch.nn.Module, kernels) -> bool:
    """Give a model whose embedding was left unloaded (load_gguf_model's ``embedding_from_head``) the lookup in its
    quantized head; False if its embedding is loaded. A tensor-parallel rank's embedding looks its vocabulary slice
    up (``lookup``) in its slice of the head (``linear``): sharding.VocabParallelEmbedding and VocabParallelHead."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    table, head = getattr(embedding, "lookup", embedding), getattr(head, "linear", head)
    if not table.weight.is_meta:
        return False
    if not isinstance(head, QuantizedLinear):
        raise RuntimeError(f"the token embedding was left for the head's panels, but the head is a {type(head)}")
    panels = HeadPanelEmbedding(head, model.dtype, kernels)
    if table is embedding:
        model.set_input_embeddings(panels)
    else:
        embedding.lookup = panels
    return True
