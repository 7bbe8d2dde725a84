"""Attention kernels: flash attention over the KV cache, and its small-head variant."""
