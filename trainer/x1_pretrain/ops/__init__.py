"""GPU operations below the model: Triton kernels, cuBLASLt matmuls, float8 and the fused losses."""
