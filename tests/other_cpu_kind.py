"""Prints the env settings under which this machine runs as the other kind of CPU, for the second CI pass of the
tests marked ``cpu_isa`` (see the Makefile): an AVX512_BF16/AMX machine runs as an AVX2-only one (its kernels,
torch's and MKL's held to AVX2, float32 for --dtype auto); an AVX2 machine has --dtype auto pick bfloat16."""

from pagedllm.backends.common import cpu_features

if cpu_features.has_native_bf16(cpu_features.detected_level()):
    env = {cpu_features.ENV: "avx2", **cpu_features.library_caps("avx2")}
else:
    env = {cpu_features.ENV: "avx512_bf16"}
print(" ".join(f"{name}={value}" for name, value in env.items()))
