"""The cpu backend's layers: paged attention, fused decoder layers, packed linear layers, RMSNorm, rotary
embeddings and SiLU-and-multiply, each over its C++ kernel."""
