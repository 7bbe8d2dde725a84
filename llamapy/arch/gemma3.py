"""The gemma3 architecture (Gemma 3 text models: 270M, 1B, 4B, 12B, 27B).

What sets it apart from llama (llama.cpp's llm_build_gemma3 and its hparams loader):
token embeddings scaled by sqrt(n_embd); RMS norms on Q and K per head (QK-norm); a
norm after attention and after the FFN, before each residual add ("sandwich" norms);
GeGLU with tanh GELU; NEOX RoPE; head size from attention.key_length (not n_embd /
n_head); Q multiplied by 1/sqrt(head_dim) before attention (by 1/sqrt(n_embd / n_head)
on the 27B); sliding-window attention on five layers of every six, whose RoPE base is
10000, the sixth attending globally with rope.freq_base; output tied to the embeddings.
The GGUF norm weights already include Hugging Face's "+ 1".
"""
from __future__ import annotations

import numpy as np

import ggmlpy as gg

from ..errors import UnsupportedModelError
from ..hparams import HParams, read_common
from .base import Architecture, register
from .hf import COMMON_LAYER, QK_NORM_LAYER, HFConversion, require

SWA_PATTERN = 6          # every sixth layer attends to the whole context
ROPE_FREQ_BASE_SWA = 10000.0
NEW_MODEL_SLIDING_WINDOW = 512  # Gemma 3's own window, for new_model


def _write_hparams(meta, hp: dict, rope: dict) -> None:
    """What convert_hf_to_gguf.py's Gemma3Model adds (keys set again keep their place; the
    soft-caps Gemma 3 has not are refused by convert.config.Gemma3Config)."""
    meta.u32("gemma3.context_length", hp.get("max_position_embeddings", 131072))
    meta.u32("gemma3.attention.head_count", hp.get("num_attention_heads", 8))
    meta.f32("gemma3.attention.layer_norm_rms_epsilon", hp.get("rms_norm_eps", 1e-6))
    meta.u32("gemma3.attention.key_length", hp.get("head_dim", 256))
    meta.u32("gemma3.attention.value_length", hp.get("head_dim", 256))
    meta.f32("gemma3.rope.freq_base", rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
    if softcap := hp.get("final_logit_softcapping"):
        meta.f32("gemma3.final_logit_softcapping", softcap)
    if hp.get("sliding_window_pattern") != 1:
        meta.u32("gemma3.attention.sliding_window", require(hp, "sliding_window"))
    meta.u32("gemma3.attention.head_count_kv", hp.get("num_key_value_heads", 4))


@register
class Gemma3(Architecture):
    bos_in_every_window = True  # scores ~2 nats worse on text that does not start with BOS
    name = "gemma3"
    layer_tensors = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                     "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
    head_dim_in_metadata = True
    ties_output = True
    default_sliding_window = NEW_MODEL_SLIDING_WINDOW
    hf = HFConversion(("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                      {**COMMON_LAYER, **QK_NORM_LAYER, "post_attention_layernorm": "post_attention_norm",
                       "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
                      dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                           max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                           rope_local_base_freq=10000.0, sliding_window=4096),
                      config_record="Gemma3Config", norm_shift=True, tokenizer="gemma", write_hparams=_write_hparams)

    def read_hparams(self, f, n_vocab: int) -> HParams:
        hp = read_common(f, self.name, n_vocab, gg.ROPE_TYPE_NEOX)
        hp.n_swa = f.get_int(f"{self.name}.attention.sliding_window", 0)
        if hp.n_swa > 0:
            hp.set_swa_pattern(SWA_PATTERN)
            hp.rope_freq_base_swa = ROPE_FREQ_BASE_SWA
        if f.get_float(f"{self.name}.final_logit_softcapping", 0.0):
            raise UnsupportedModelError(f"{f.path}: gemma3 with final logit softcapping is not supported")
        if hp.n_embd_head_k != hp.n_embd_head_v:
            raise UnsupportedModelError(f"{f.path}: gemma3 needs equal K and V head sizes "
                                        f"({hp.n_embd_head_k} != {hp.n_embd_head_v})")
        head = hp.n_embd // hp.n_head if hp.n_layer == 62 else hp.n_embd_head_k  # 62 layers: the 27B
        hp.f_attention_scale = float(np.float32(1.0) / np.sqrt(np.float32(head)))
        return hp

    def build(self, g, model):
        c, hp, w = g.ctx, g.hp, model.weight
        n_tokens, hd = g.shape.n_tokens, hp.n_embd_head_k
        inp = g.token_embeddings(w("token_embd.weight"))
        inp = gg.scale(c, inp, float(np.sqrt(np.float32(hp.n_embd))))
        for il in range(hp.n_layer):
            blk = f"blk.{il}."
            g.layer_boundary(inp)
            base = hp.rope_base_of(il)
            cur = g.norm_rms(inp, w(blk + "attn_norm.weight"))
            q = gg.reshape(c, g.mm(blk + "attn_q.weight", cur), hd, hp.n_head, n_tokens)
            k = gg.reshape(c, g.mm(blk + "attn_k.weight", cur), hd, hp.n_head_kv, n_tokens)
            v = gg.reshape(c, g.mm(blk + "attn_v.weight", cur), hd, hp.n_head_kv, n_tokens)
            q = g.rope(g.norm_rms(q, w(blk + "attn_q_norm.weight")), base)
            k = g.rope(g.norm_rms(k, w(blk + "attn_k_norm.weight")), base)
            q = gg.scale(c, q, hp.f_attention_scale)
            cur = g.attention(il, q, k, v, kq_scale=1.0, n_swa=hp.n_swa_of(il))
            cur = g.mm(blk + "attn_output.weight", cur)
            if il == hp.n_layer - 1:
                cur, inp = g.select_outputs(cur), g.select_outputs(inp)
            cur = g.norm_rms(cur, w(blk + "post_attention_norm.weight"))
            sa_out = gg.add(c, cur, inp)
            cur = g.norm_rms(sa_out, w(blk + "ffn_norm.weight"))
            gate = g.mm(blk + "ffn_gate.weight", cur)
            up = g.mm(blk + "ffn_up.weight", cur)
            cur = g.mm(blk + "ffn_down.weight", gg.geglu_split(c, gate, up))
            cur = g.norm_rms(cur, w(blk + "post_ffw_norm.weight"))
            inp = gg.add(c, cur, sa_out)
        cur = g.norm_rms(g.layer_boundary(inp), w("output_norm.weight"))
        return g.output(model.output_weight, cur)
