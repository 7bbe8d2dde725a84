"""Building one ubatch's compute graph: inputs, attention over the KV cache, outputs.

This is llama.cpp's llm_graph_context: the parts every architecture shares. An
architecture module only says how its layers combine these pieces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType, Tensor

from .kv_cache import KVMemory


@dataclass(frozen=True)
class GraphShape:
    """Everything a ubatch graph's structure depends on; equal shapes reuse one graph."""

    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    stream0: int
    n_kv: tuple[int, ...]  # cells attention spans, per KV cache
    n_outputs: int
    samplers: tuple = ()  # per output row: the backend signature of its sampler chain, or None


class GraphBuilder:
    def __init__(self, model, kv: KVMemory, shape: GraphShape, flash_attn: bool = True, adapters=()) -> None:
        self.model = model
        self.adapters = tuple(adapters)  # (LoraAdapter, scale) pairs applied by mm()
        self.flash_attn = flash_attn
        self.hp = model.hparams
        self.kv = kv
        self.shape = shape
        self.ctx = gg.Context()
        self.graph = gg.Graph()
        c = self.ctx
        self.inp_tokens = c.new_tensor_1d(GGMLType.I32, shape.n_tokens, "inp_tokens").set_input()
        self.inp_pos = c.new_tensor_1d(GGMLType.I32, shape.n_tokens, "inp_pos").set_input()
        # where this ubatch's K/V rows go, per cache
        self.inp_k_rows = [c.new_tensor_1d(GGMLType.I64, shape.n_tokens, f"inp_k_rows{i}").set_input()
                           for i in range(len(kv.caches))]
        self.inp_masks: dict[tuple[int, int], Tensor] = {}  # (cache, sliding window or 0) -> mask
        self.inp_out_ids = None
        self.sampler_rows: list = [None] * shape.n_outputs  # backend samplers per output row
        if shape.n_outputs < shape.n_tokens:
            self.inp_out_ids = c.new_tensor_1d(GGMLType.I32, shape.n_outputs, "inp_out_ids").set_input()

    # ---- inputs ----------------------------------------------------------------------
    def token_embeddings(self, tok_embd: Tensor) -> Tensor:
        return gg.get_rows(self.ctx, tok_embd, self.inp_tokens)

    def kq_mask(self, cache: int = 0, n_swa: int = 0) -> Tensor:
        key = (cache, n_swa)
        if key not in self.inp_masks:
            s = self.shape
            self.inp_masks[key] = self.ctx.new_tensor_4d(
                GGMLType.F32, s.n_kv[cache], s.n_seq_tokens, 1, s.n_seqs, f"kq_mask{cache}_swa{n_swa}").set_input()
        return self.inp_masks[key]

    def set_inputs(self, ub, k_rows: list[np.ndarray]) -> None:
        self.inp_tokens.array().reshape(-1)[:] = ub.tokens
        self.inp_pos.array().reshape(-1)[:] = ub.pos
        for inp, rows in zip(self.inp_k_rows, k_rows):
            inp.array().reshape(-1)[:] = rows
        for (cache, n_swa), mask in self.inp_masks.items():
            self.kv.caches[cache].fill_mask(ub, self.shape.n_kv[cache], mask.array(), n_swa)
        if self.inp_out_ids is not None:
            self.inp_out_ids.array().reshape(-1)[:] = np.flatnonzero(ub.output)

    # ---- common blocks ------------------------------------------------------------------
    def mm(self, name: str, cur: Tensor) -> Tensor:
        """W x for the model tensor `name`, plus each attached LoRA's scaled B (A x)."""
        c = self.ctx
        res = gg.mul_mat(c, self.model.weight(name), cur)
        for adapter, scale in self.adapters:
            if name in adapter.tensors:
                a, b = adapter.tensors[name]
                delta = gg.mul_mat(c, b, gg.mul_mat(c, a, cur))
                res = gg.add(c, res, gg.scale(c, delta, scale * adapter.scale_for(name)))
        return res

    def norm_rms(self, x: Tensor, weight: Tensor | None) -> Tensor:
        cur = gg.rms_norm(self.ctx, x, self.hp.norm_rms_eps)
        return gg.mul(self.ctx, cur, weight) if weight is not None else cur

    def rope(self, x: Tensor, freq_base: float | None = None) -> Tensor:
        hp = self.hp
        return gg.rope_ext(self.ctx, x, self.inp_pos, None, hp.n_rot, hp.rope_type, hp.n_ctx_train,
                           hp.rope_freq_base if freq_base is None else freq_base, hp.rope_freq_scale)

    def select_outputs(self, x: Tensor) -> Tensor:
        """Keep only the rows of tokens whose outputs were requested (last layer)."""
        return x if self.inp_out_ids is None else gg.get_rows(self.ctx, x, self.inp_out_ids)

    def attention(self, il: int, q: Tensor, k: Tensor, v: Tensor, kq_scale: float | None = None,
                  n_swa: int = 0) -> Tensor:
        """Store k, v for this ubatch in the cache and attend over the cache.

        q: [head_dim, n_head, n_tokens], k/v: [head_dim, n_head_kv, n_tokens]; returns
        [n_head * head_dim_v, n_tokens].
        """
        c, hp, s = self.ctx, self.hp, self.shape
        ci = self.kv.cache_index[il]
        kv, n_kv, k_rows = self.kv.caches[ci], s.n_kv[ci], self.inp_k_rows[ci]
        cache_k, cache_v = kv.k[il], kv.v[il]
        # write this ubatch's K and V rows (ordered before the reads below)
        rows_k = gg.reshape(c, cache_k, hp.n_embd_k_gqa, kv.kv_size * kv.n_stream)
        rows_v = gg.reshape(c, cache_v, hp.n_embd_v_gqa, kv.kv_size * kv.n_stream)
        self.graph.visit(gg.set_rows(c, rows_k, gg.reshape(c, k, hp.n_embd_k_gqa, s.n_tokens), k_rows))
        self.graph.visit(gg.set_rows(c, rows_v, gg.reshape(c, v, hp.n_embd_v_gqa, s.n_tokens), k_rows))

        hk, hv = hp.n_embd_head_k, hp.n_embd_head_v
        stream_k, stream_v = cache_k.nb[2], cache_v.nb[2]
        kview = gg.view_4d(c, cache_k, hk, n_kv, hp.n_head_kv, s.n_seqs,
                           cache_k.nb[1], hk * cache_k.nb[0], stream_k, s.stream0 * stream_k)
        q = gg.reshape(c, q, hk, hp.n_head, s.n_seq_tokens, s.n_seqs)
        q = gg.permute(c, q, 0, 2, 1, 3)  # [head_dim, n_seq_tokens, n_head, n_seqs]
        scale = 1.0 / math.sqrt(hk) if kq_scale is None else kq_scale
        mask = self.kq_mask(ci, n_swa)
        if self.flash_attn:
            vview = gg.view_4d(c, cache_v, hv, n_kv, hp.n_head_kv, s.n_seqs,
                               cache_v.nb[1], hv * cache_v.nb[0], stream_v, s.stream0 * stream_v)
            out = gg.flash_attn_ext(c, q, kview, vview, mask, scale)  # [head_dim, n_head, n_seq_tokens, n_seqs]
            return gg.reshape(c, out, hv * hp.n_head, s.n_tokens)
        vview = gg.view_4d(c, cache_v, hv, hp.n_head_kv, n_kv, s.n_seqs,
                           hv * cache_v.nb[0], cache_v.nb[1], stream_v, s.stream0 * stream_v)
        vview = gg.permute(c, vview, 1, 2, 0, 3)  # [n_kv, head_dim, n_head_kv, n_seqs]
        kq = gg.mul_mat(c, kview, q)      # [n_kv, n_seq_tokens, n_head, n_seqs]
        kq = gg.soft_max_ext(c, kq, mask, scale, 0.0)
        kqv = gg.mul_mat(c, vview, kq)    # [head_dim, n_seq_tokens, n_head, n_seqs]
        cur = gg.permute(c, kqv, 0, 2, 1, 3)
        return gg.cont(c, cur, hv * hp.n_head, s.n_tokens)

    def finish(self, logits: Tensor) -> Tensor:
        logits.set_name("result_output").set_output()
        self.graph.visit(logits)
        return logits
