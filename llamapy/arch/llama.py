"""The llama architecture (Llama 1/2/3, TinyLlama, llama2.c stories models, ...)."""
from __future__ import annotations

import ggmlpy as gg

from ..hparams import HParams, read_common
from .base import Architecture, register


@register
class Llama(Architecture):
    name = "llama"

    def read_hparams(self, f, n_vocab: int) -> HParams:
        return read_common(f, self.name, n_vocab, gg.ROPE_TYPE_NORM)

    layer_tensors = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                     "ffn_down")

    def build(self, g, model):
        c, hp, w = g.ctx, g.hp, model.weight
        n_tokens = g.shape.n_tokens
        inp = g.token_embeddings(w("token_embd.weight"))
        for il in range(hp.n_layer):
            blk = f"blk.{il}."
            cur = g.norm_rms(inp, w(blk + "attn_norm.weight"))
            q = gg.reshape(c, g.mm(blk + "attn_q.weight", cur), hp.n_embd_head_k, hp.n_head, n_tokens)
            k = gg.reshape(c, g.mm(blk + "attn_k.weight", cur), hp.n_embd_head_k, hp.n_head_kv, n_tokens)
            v = gg.reshape(c, g.mm(blk + "attn_v.weight", cur), hp.n_embd_head_v, hp.n_head_kv, n_tokens)
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
        cur = g.norm_rms(inp, w("output_norm.weight"))
        return g.finish(gg.mul_mat(c, model.output_weight, cur))
