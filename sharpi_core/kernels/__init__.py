"""Hand-written compute kernels (`cpu`: quantized GGUF matmuls in C, built on first use)."""
