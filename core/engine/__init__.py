"""The engine and its clients: ``LLMEngine`` (one step: schedule, execute, sample), the offline ``LLM``, the
engine-core loop that runs in a process (or thread) of its own, and the front ends that talk to it."""
