"""The qwen3 architecture (Qwen3 dense: 0.6B-32B): llama's layers with NEOX RoPE, no
biases, and an RMS norm over each head of Q and K before RoPE (QK-norm), the head size
from attention.key_length (llama.cpp's llm_build_qwen3)."""
from __future__ import annotations

import ggmlpy as gg

from .base import register
from .hf import COMMON_LAYER, QK_NORM_LAYER, HFConversion
from .llama import Llama


@register
class Qwen3(Llama):
    name = "qwen3"
    rope_type = gg.ROPE_TYPE_NEOX
    layer_tensors = Llama.layer_tensors + ("attn_q_norm", "attn_k_norm")
    optional_layer_biases = ()
    optional_global_tensors = ("output.weight",)
    head_dim_in_metadata = True
    hf = HFConversion(("Qwen3ForCausalLM",), {**COMMON_LAYER, **QK_NORM_LAYER, "post_attention_layernorm": "ffn_norm"},
                      dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                           max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0))

    def queries_keys_values(self, g, blk: str, cur):
        q, k, v = super().queries_keys_values(g, blk, cur)
        w = g.model.weight
        return g.norm_rms(q, w(blk + "attn_q_norm.weight")), g.norm_rms(k, w(blk + "attn_k_norm.weight")), v
