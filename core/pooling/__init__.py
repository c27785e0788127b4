"""Pooling requests (embeddings, scores): one forward pass per prompt, its hidden states pooled into a vector."""

from pagedllm.pooling.params import PoolingParams

__all__ = ["PoolingParams"]
