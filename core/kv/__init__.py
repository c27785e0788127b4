"""KV cache accounting: the block allocator, the prefix cache, the manager the scheduler asks for blocks, and how
many blocks the memory holds. The cache's tensors are the backend's."""
