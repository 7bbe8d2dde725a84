"""The qwen2 architecture (Qwen2, Qwen2.5: 0.5B-72B): llama's layers with NEOX RoPE and
biases on the Q, K and V projections (llama.cpp's llm_build_qwen2)."""
from __future__ import annotations

import ggmlpy as gg

from .base import register
from .hf import COMMON_LAYER, HFConversion
from .llama import Llama


@register
class Qwen2(Llama):
    name = "qwen2"
    rope_type = gg.ROPE_TYPE_NEOX
    layer_biases = ("attn_q", "attn_k", "attn_v")
    optional_layer_biases = ()
    optional_global_tensors = ("output.weight",)
    hf = HFConversion(("Qwen2ForCausalLM",), {**COMMON_LAYER, "post_attention_layernorm": "ffn_norm"},
                      dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                           rms_norm_eps=1e-6, rope_theta=10000.0))
