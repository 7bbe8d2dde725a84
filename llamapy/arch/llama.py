"""The llama architecture (Llama 1/2/3, TinyLlama, llama2.c stories models, ...).

Llama 3.1+ files carry `rope_freqs.weight`, RoPE frequency factors for the rotated
pairs, which every layer's rope divides its angles by; some llama files carry biases on
the projections. Both are used when present (llama.cpp's TENSOR_NOT_REQUIRED tensors).
"""
from __future__ import annotations

import ggmlpy as gg

from ..errors import UnsupportedModelError
from ..hparams import HParams, read_common
from .base import Architecture, register

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@register
class Llama(Architecture):
    name = "llama"
    rope_type = gg.ROPE_TYPE_NORM
    layer_tensors = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                     "ffn_down")
    optional_layer_biases = PROJECTIONS
    optional_global_tensors = ("output.weight", "rope_freqs.weight")

    def read_hparams(self, f, n_vocab: int) -> HParams:
        hp = read_common(f, self.name, n_vocab, self.rope_type)
        if not hp.n_rot == hp.n_embd_head_k == hp.n_embd_head_v:  # llama.cpp's graph asserts as much
            raise UnsupportedModelError(f"{f.path}: {self.name} needs rope.dimension_count ({hp.n_rot}) equal to the "
                                        f"head size (K {hp.n_embd_head_k}, V {hp.n_embd_head_v})")
        return hp

    def queries_keys_values(self, g, blk: str, cur):
        """Q, K, V of one layer as [head_dim, n_head(_kv), n_tokens], before RoPE."""
        c, hp, n_tokens = g.ctx, g.hp, g.shape.n_tokens
        q = gg.reshape(c, g.mm(blk + "attn_q.weight", cur), hp.n_embd_head_k, hp.n_head, n_tokens)
        k = gg.reshape(c, g.mm(blk + "attn_k.weight", cur), hp.n_embd_head_k, hp.n_head_kv, n_tokens)
        v = gg.reshape(c, g.mm(blk + "attn_v.weight", cur), hp.n_embd_head_v, hp.n_head_kv, n_tokens)
        return q, k, v

    def build(self, g, model):
        c, hp, w = g.ctx, g.hp, model.weight
        inp = g.token_embeddings(w("token_embd.weight"))
        for il in range(hp.n_layer):
            blk = f"blk.{il}."
            g.layer_boundary(inp)
            cur = g.norm_rms(inp, w(blk + "attn_norm.weight"))
            q, k, v = self.queries_keys_values(g, blk, cur)
            cur = g.attention(il, g.rope(q), g.rope(k), v)
            cur = g.mm(blk + "attn_output.weight", cur)
            if il == hp.n_layer - 1:
                cur, inp = g.select_outputs(cur), g.select_outputs(inp)
            ffn_inp = gg.add(c, cur, inp)
            cur = g.norm_rms(ffn_inp, w(blk + "ffn_norm.weight"))
            gate = g.mm(blk + "ffn_gate.weight", cur)
            up = g.mm(blk + "ffn_up.weight", cur)
            cur = g.mm(blk + "ffn_down.weight", gg.swiglu_split(c, gate, up))
            inp = gg.add(c, cur, ffn_inp)
        cur = g.norm_rms(g.layer_boundary(inp), w("output_norm.weight"))
        return g.output(model.output_weight, cur)
