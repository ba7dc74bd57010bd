"""Quantized weights: block formats (blocks.py), made at load and read back (reference.py), and the
matmuls that read them as stored (matmul.py: the C++ kernels on CPU, Triton on CUDA)."""
