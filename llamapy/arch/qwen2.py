"""The qwen2 architecture (Qwen2, Qwen2.5: 0.5B-72B): llama's layers with NEOX RoPE and
biases on the Q, K and V projections (llama.cpp's llm_build_qwen2)."""
from __future__ import annotations

import ggmlpy as gg

from .base import register
from .llama import Llama


@register
class Qwen2(Llama):
    name = "qwen2"
    rope_type = gg.ROPE_TYPE_NEOX
    layer_biases = ("attn_q", "attn_k", "attn_v")
    optional_layer_biases = ()
    optional_global_tensors = ("output.weight",)
