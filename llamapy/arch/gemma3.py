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

SWA_PATTERN = 6          # every sixth layer attends to the whole context
ROPE_FREQ_BASE_SWA = 10000.0


@register
class Gemma3(Architecture):
    bos_in_every_window = True  # scores ~2 nats worse on text that does not start with BOS
    name = "gemma3"
    layer_tensors = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                     "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")

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
