"""Fused multi-layer gather/scatter kernels for CUDA pages (``kv_copy.cu``, run with
cupy), the plans they execute and a CPU reference of their arithmetic."""
