"""Quantized weights: GGUF blocks kept as they are, dequantisers and matmul kernels over them."""
