"""The torch CPU backend: transformers' model classes over a paged KV cache."""
