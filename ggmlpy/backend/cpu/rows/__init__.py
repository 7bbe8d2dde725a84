"""Element-wise and row ops (norms, RoPE, softmax, copies, gathers), fused pairs, sampling ops."""
