"""Running a model on this process's CPUs: the model runner (load, patch in the fused layers, execute a step), the
architectures it takes, the C++ kernels' build, thread binding, a tensor-parallel rank's shard of the model, weights
on huge pages, and the allocator."""
