"""Choosing the next token: the sampler (penalties, temperature, top-k/p, min-p, seeds, logprobs) and structured
outputs (grammars that mask the logits)."""
