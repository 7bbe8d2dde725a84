"""The products: MUL_MAT and OUT_PROD (float, BLAS, packed quantized rows), the CPU type table."""
