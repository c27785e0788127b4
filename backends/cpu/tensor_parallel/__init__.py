"""Tensor parallelism for the cpu backend: worker processes on torch.distributed, the wire
format of a step, and the launcher for ranks on other machines."""
