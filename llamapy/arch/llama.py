"""The llama architecture (Llama 1/2/3, TinyLlama, llama2.c stories models, ...).

Llama 3.1+ files carry `rope_freqs.weight`, RoPE frequency factors for the rotated
pairs, which every layer's rope divides its angles by; some llama files carry biases on
the projections. Both are used when present (llama.cpp's TENSOR_NOT_REQUIRED tensors).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

import ggmlpy as gg

from ..errors import UnsupportedModelError
from ..hparams import HParams, read_common
from .base import Architecture, register
from .hf import COMMON_LAYER, HFConversion, require

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _write_hparams(meta, hp: dict, rope: dict) -> None:
    """What convert_hf_to_gguf.py's LlamaModel adds: the vocabulary size and the rotated dimensions."""
    meta.u32("llama.vocab_size", require(hp, "vocab_size"))
    meta.u32("llama.rope.dimension_count", hp["head_dim"])


def _rope_freqs(hp: dict, rope: dict) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """Llama 3's RoPE scaling as the tensor convert adds: rope_freqs, one factor per frequency
    pair, computed in float32 as convert does."""
    full = rope.get("full_attention", rope)
    if str(full.get("rope_type", "")).lower() != "llama3":
        return

    def factors() -> np.ndarray:
        f32 = np.float32
        dim = hp["head_dim"]
        freqs = f32(full.get("rope_theta", 10000.0)) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim))
        freqs = f32(1.0) / freqs
        factor = full.get("factor", 8.0)
        low, high = full.get("low_freq_factor", 1.0), full.get("high_freq_factor", 4.0)
        old = full.get("original_max_position_embeddings", 8192)
        out = []
        for freq in freqs:
            wavelen = f32(2 * math.pi) / freq
            if wavelen < old / high:
                out.append(1.0)
            elif wavelen > old / low:
                out.append(factor)
            else:
                smooth = (f32(old) / wavelen - f32(low)) / f32(high - low)
                out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
        return np.asarray(out, dtype=np.float32)

    yield "rope_freqs.weight", factors


@register
class Llama(Architecture):
    name = "llama"
    rope_type = gg.ROPE_TYPE_NORM
    layer_tensors = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                     "ffn_down")
    optional_layer_biases = PROJECTIONS
    optional_global_tensors = ("output.weight", "rope_freqs.weight")
    hf = HFConversion(("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
                      {**COMMON_LAYER, "post_attention_layernorm": "ffn_norm"},
                      dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                           num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                           rope_theta=10000.0),
                      permute_qk=True, derived_heads=True, tokenizer="llama", write_hparams=_write_hparams,
                      extra_tensors=_rope_freqs)

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
