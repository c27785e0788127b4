"""User-facing entry points: the ``pagedllm`` command."""
