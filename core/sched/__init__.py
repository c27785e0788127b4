"""Scheduling: requests and their state, the scheduler (token budget, chunked prefill, preemption), and the
builder that turns its decisions into the backend's flat ``Batch``."""
