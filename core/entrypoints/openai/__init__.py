"""The OpenAI-compatible HTTP server behind ``pagedllm serve``."""
