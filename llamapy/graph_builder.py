"""Building one ubatch's compute graph: inputs, attention, outputs.

This is llama.cpp's llm_graph_context: the parts every architecture shares. An
architecture module only says how its layers combine these pieces. Attention reads its
keys and values through an *attention input*, as llama.cpp's llm_graph_input_attn_*:
`KVCacheInput` writes the ubatch's K/V into the KV cache and attends over the cells in
use (inference); `WindowInput` attends over the earlier K/V of a training window, given
as graph inputs that receive gradients, and the ubatch's own (training, no cache). The
attention itself is the same code for both.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

import ggmlpy as gg
from ggmlpy import GGMLType, Tensor

from .batch import UBatch
from .hparams import HParams
from .kv_cache import KVMemory


class GraphShape(NamedTuple):
    """Everything a ubatch graph's structure depends on; equal shapes reuse one graph (a
    tuple: made, hashed and compared once per decode, cheaply)."""

    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    stream0: int
    n_kv: tuple[int, ...]  # cells attention spans, per KV cache
    n_outputs: int
    samplers: tuple = ()  # per output row: the backend signature of its sampler chain, or None
    embeddings: bool = False  # the normed last hidden states leave the graph too (llama.cpp's t_embd)


class _AttentionInput:
    """What both attention inputs share: one mask input per (cache, sliding window)."""

    def __init__(self, ctx: gg.Context, hp: HParams, shape: GraphShape) -> None:
        self.ctx, self.hp, self.shape = ctx, hp, shape
        self.masks: dict[tuple[int, int], Tensor] = {}
        self.views = TensorViews()

    def cache_of(self, il: int) -> int:
        return 0

    def mask(self, il: int, n_swa: int) -> Tensor:
        """The KQ mask of layer il's cache: [n_kv, n_seq_tokens, 1, n_seqs], 0 or -inf."""
        key = (self.cache_of(il), n_swa)
        if key not in self.masks:
            s = self.shape
            self.masks[key] = self.ctx.new_tensor_4d(GGMLType.F32, s.n_kv[key[0]], s.n_seq_tokens, 1, s.n_seqs,
                                                     f"kq_mask{key[0]}_swa{n_swa}").set_input()
        return self.masks[key]


class KVCacheInput(_AttentionInput):
    """Attention over the KV cache: the ubatch's K and V rows are written into cells found
    for them (one row index input per cache) and attention spans the first n_kv cells."""

    def __init__(self, ctx: gg.Context, hp: HParams, shape: GraphShape, kv: KVMemory) -> None:
        super().__init__(ctx, hp, shape)
        self.kv = kv
        self.k_rows = [ctx.new_tensor_1d(GGMLType.I64, shape.n_tokens, f"inp_k_rows{i}").set_input()
                       for i in range(len(kv.caches))]

    def cache_of(self, il: int) -> int:
        return self.kv.cache_index[il]

    def keys_values(self, graph: gg.Graph, il: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        c, hp, s = self.ctx, self.hp, self.shape
        ci = self.cache_of(il)
        cache, n_kv = self.kv.caches[ci], s.n_kv[ci]
        cache_k, cache_v = cache.k[il], cache.v[il]
        # write this ubatch's K and V rows (ordered before the reads below)
        rows_k = gg.reshape(c, cache_k, hp.n_embd_k_gqa, cache.kv_size * cache.n_stream)
        rows_v = gg.reshape(c, cache_v, hp.n_embd_v_gqa, cache.kv_size * cache.n_stream)
        graph.visit(gg.set_rows(c, rows_k, gg.reshape(c, k, hp.n_embd_k_gqa, s.n_tokens), self.k_rows[ci]))
        graph.visit(gg.set_rows(c, rows_v, gg.reshape(c, v, hp.n_embd_v_gqa, s.n_tokens), self.k_rows[ci]))
        views = []
        for t, d in ((cache_k, hp.n_embd_head_k), (cache_v, hp.n_embd_head_v)):
            stream = t.nb[2]
            views.append(gg.view_4d(c, t, d, n_kv, hp.n_head_kv, s.n_seqs, t.nb[1], d * t.nb[0], stream,
                                    s.stream0 * stream))
        return views[0], views[1]

    def set_inputs(self, ub: UBatch, k_rows: list[np.ndarray]) -> None:
        for inp, rows in zip(self.k_rows, k_rows):
            self.views(inp)[:] = rows
        for (cache, n_swa), mask in self.masks.items():
            self.kv.caches[cache].fill_mask(ub, self.shape.n_kv[cache], self.views(mask, flat=False), n_swa)


class TensorViews:
    """Numpy views of a graph's inputs and outputs, each made once per binding of its tensor:
    they are read and written every decode, and a new view costs more than a token's row of
    work."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, bool], tuple[Tensor, int, np.ndarray]] = {}

    def __call__(self, t: Tensor, flat: bool = True) -> np.ndarray:
        """t's data (flat: as 1-D)."""
        binding = (t.view_src or t).binding  # a view's bytes are its source's
        got = self._views.get((id(t), flat))
        if got is not None and got[0] is t and got[1] == binding:
            return got[2]
        a = t.array()
        a = a.reshape(-1) if flat else a
        self._views[(id(t), flat)] = (t, binding, a)
        return a


@dataclass(frozen=True)
class WindowCells:
    """The position and sequence of each token of a training window up to the end of the
    ubatch (the cells a WindowInput attends over). Several sequences in one window are
    packed samples, which never see each other."""

    pos: np.ndarray  # int32 [n_prev + n_tokens]
    seq: np.ndarray  # int32 [n_prev + n_tokens]


class WindowInput(_AttentionInput):
    """Attention inside a training window without a cache: the K and V of the window's
    n_prev earlier tokens are graph inputs flagged param (so their gradients can be
    carried back to the ubatches that made them); this ubatch's own K and V are outputs."""

    def __init__(self, ctx: gg.Context, hp: HParams, shape: GraphShape, n_prev: int) -> None:
        super().__init__(ctx, hp, shape)
        self.n_prev = n_prev
        self.k_prev: list[Tensor] = []
        self.v_prev: list[Tensor] = []
        self.k_cur: list[Tensor] = []
        self.v_cur: list[Tensor] = []
        for il in range(hp.n_layer if n_prev else 0):
            for name, store, dim in (("k", self.k_prev, hp.n_embd_head_k), ("v", self.v_prev, hp.n_embd_head_v)):
                t = ctx.new_tensor_3d(GGMLType.F32, dim, hp.n_head_kv, n_prev, f"{name}_prev.{il}")
                store.append(t.set_input().set_param())

    def keys_values(self, graph: gg.Graph, il: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        c = self.ctx
        self.k_cur.append(k)
        self.v_cur.append(v)
        if self.n_prev:
            k = gg.concat(c, self.k_prev[il], k, 2)
            v = gg.concat(c, self.v_prev[il], v, 2)
        # [head_dim, n_head_kv, n_kv] -> [head_dim, n_kv, n_head_kv], as the cache's views
        return gg.permute(c, k, 0, 2, 1, 3), gg.permute(c, v, 0, 2, 1, 3)

    def set_inputs(self, ub: UBatch, cells: WindowCells) -> None:
        """The KQ masks: a token sees the cells of its own sequence at earlier or equal
        positions (less than n_swa back with a sliding window), as kv_cache.fill_kq_mask
        sees cache cells. Sequence ids are compared, not bit sets: a window may pack more
        samples than a bit set holds."""
        same_seq = cells.seq[None, :] == ub.seq_id[:, None]
        back = ub.pos[:, None] - cells.pos[None, :]  # [n_tokens, n_kv]: how far back each cell is
        for (_, n_swa), mask in self.masks.items():
            visible = same_seq & (back >= 0) & ((back < n_swa) if n_swa > 0 else True)
            mask.array()[0, 0] = np.where(visible, np.float32(0.0), np.float32(-np.inf))


class GraphBuilder:
    """One ubatch's graph. Built through `for_cache` (inference) or `for_window` (training)."""

    def __init__(self, model, shape: GraphShape, attention_input: Callable[[gg.Context], _AttentionInput],
                 flash_attn: bool = True, adapters=(), logits_out: bool = True) -> None:
        self.model = model
        self.adapters = tuple(adapters)  # (LoraAdapter, scale) pairs applied by mm()
        self.flash_attn = flash_attn
        self.logits_out = logits_out
        self.hp = model.hparams
        self.shape = shape
        self.ctx = gg.Context()
        self.graph = gg.Graph()
        c = self.ctx
        self.inp_tokens = c.new_tensor_1d(GGMLType.I32, shape.n_tokens, "inp_tokens").set_input()
        self.inp_pos = c.new_tensor_1d(GGMLType.I32, shape.n_tokens, "inp_pos").set_input()
        self.attn = attention_input(c)
        self.views = self.attn.views
        self.inp_out_ids = None
        self.sampler_rows: list = [None] * shape.n_outputs  # backend samplers per output row
        if shape.n_outputs < shape.n_tokens:
            self.inp_out_ids = c.new_tensor_1d(GGMLType.I32, shape.n_outputs, "inp_out_ids").set_input()
        self.logits: Tensor | None = None
        self.embd: Tensor | None = None  # the output layer's input: [n_embd, n_outputs]
        self.boundaries: list[Tensor] = []  # the residual stream between layers (gradient checkpoints)
        self.head: tuple[Tensor, Tensor] | None = None  # (output weight, its input) when the loss takes the layer

    @classmethod
    def for_cache(cls, model, kv: KVMemory, shape: GraphShape, flash_attn: bool = True, adapters=()) -> "GraphBuilder":
        """An inference ubatch: K/V through the KV cache, the logits an output of the graph."""
        return cls(model, shape, lambda c: KVCacheInput(c, model.hparams, shape, kv), flash_attn, adapters)

    @classmethod
    def for_window(cls, model, n_prev: int, n_tokens: int, adapters=()) -> "GraphBuilder":
        """A training ubatch after n_prev tokens of its window: logits for every token, kept
        inside the graph (the loss is computed from them); attention as matrix products,
        which have gradients."""
        shape = GraphShape(n_tokens, n_tokens, 1, 0, (n_prev + n_tokens,), n_tokens)
        return cls(model, shape, lambda c: WindowInput(c, model.hparams, shape, n_prev), False, adapters,
                   logits_out=False)

    # ---- inputs ----------------------------------------------------------------------
    def token_embeddings(self, tok_embd: Tensor) -> Tensor:
        return gg.get_rows(self.ctx, tok_embd, self.inp_tokens)

    def set_inputs(self, ub: UBatch, attn_inputs: list[np.ndarray] | WindowCells) -> None:
        """The ubatch's inputs; `attn_inputs` is what the attention input needs beside the
        ubatch: each KV cache's row indices (inference) or the window's cells (training)."""
        self.views(self.inp_tokens)[:] = ub.tokens
        self.views(self.inp_pos)[:] = ub.pos
        self.attn.set_inputs(ub, attn_inputs)
        if self.inp_out_ids is not None:
            self.views(self.inp_out_ids)[:] = np.flatnonzero(ub.output)

    def output_array(self) -> np.ndarray:
        """The logits as the last compute left them (a view of the compute buffer)."""
        return self.views(self.logits, flat=False)

    def embd_array(self) -> np.ndarray:
        """The embeddings as the last compute left them: [n_outputs, n_embd] (a view)."""
        return self.views(self.embd, flat=False).reshape(self.shape.n_outputs, -1)

    # ---- common blocks ------------------------------------------------------------------
    def layer_boundary(self, x: Tensor) -> Tensor:
        """Mark `x`, the residual stream entering a layer (or leaving the last one), as a
        place where training may keep the activations and recompute the rest (gradient
        checkpointing); returns x."""
        self.boundaries.append(x)
        return x

    def mm(self, name: str, cur: Tensor) -> Tensor:
        """W x for the model tensor `name`, plus each attached LoRA's scaled B (A x), plus
        W's bias when the model has one (in llama.cpp's order: LoRA inside, bias after)."""
        c = self.ctx
        res = gg.mul_mat(c, self.model.weight(name), cur)
        for adapter, scale in self.adapters:
            if name in adapter.tensors:
                a, b = adapter.tensors[name]
                delta = gg.mul_mat(c, b, gg.mul_mat(c, a, cur))
                res = gg.add(c, res, gg.scale(c, delta, scale * adapter.scale_for(name)))
        bias = self.model.tensors.get(name.removesuffix(".weight") + ".bias")
        return res if bias is None else gg.add(c, res, bias)

    def norm_rms(self, x: Tensor, weight: Tensor | None) -> Tensor:
        cur = gg.rms_norm(self.ctx, x, self.hp.norm_rms_eps)
        return gg.mul(self.ctx, cur, weight) if weight is not None else cur

    def rope(self, x: Tensor, freq_base: float | None = None) -> Tensor:
        hp = self.hp
        return gg.rope_ext(self.ctx, x, self.inp_pos, self.model.rope_factors, hp.n_rot, hp.rope_type, hp.n_ctx_train,
                           hp.rope_freq_base if freq_base is None else freq_base, hp.rope_freq_scale)

    def select_outputs(self, x: Tensor) -> Tensor:
        """Keep only the rows of tokens whose outputs were requested (last layer)."""
        return x if self.inp_out_ids is None else gg.get_rows(self.ctx, x, self.inp_out_ids)

    def attention(self, il: int, q: Tensor, k: Tensor, v: Tensor, kq_scale: float | None = None,
                  n_swa: int = 0) -> Tensor:
        """softmax(q k^T * scale + mask) v over the keys and values the attention input gives.

        q: [head_dim, n_head, n_tokens], k/v: [head_dim, n_head_kv, n_tokens]; returns
        [n_head * head_dim_v, n_tokens].
        """
        c, hp, s = self.ctx, self.hp, self.shape
        keys, values = self.attn.keys_values(self.graph, il, k, v)  # [head_dim, n_kv, n_head_kv, n_seqs]
        hk, hv = hp.n_embd_head_k, hp.n_embd_head_v
        q = gg.reshape(c, q, hk, hp.n_head, s.n_seq_tokens, s.n_seqs)
        q = gg.permute(c, q, 0, 2, 1, 3)  # [head_dim, n_seq_tokens, n_head, n_seqs]
        scale = 1.0 / math.sqrt(hk) if kq_scale is None else kq_scale
        mask = self.attn.mask(il, n_swa)
        if self.flash_attn:
            # as llama.cpp's build_attn_mha: flash attention reads F16 keys and values, so an F32
            # cache's (-ctk/-ctv f32) are rounded to F16 first
            keys, values = (gg.cpy(c, t, c.new_tensor(GGMLType.F16, t.ne)) if t.type == GGMLType.F32 else t
                            for t in (keys, values))
            out = gg.flash_attn_ext(c, q, keys, values, mask, scale)  # [head_dim, n_head, n_seq_tokens, n_seqs]
            return gg.reshape(c, out, hv * hp.n_head, s.n_tokens)
        kq = gg.mul_mat(c, keys, q)      # [n_kv, n_seq_tokens, n_head, n_seqs]
        kq = gg.soft_max_ext(c, kq, mask, scale, 0.0)
        kqv = gg.mul_mat(c, gg.transpose(c, values), kq)  # [head_dim, n_seq_tokens, n_head, n_seqs]
        cur = gg.permute(c, kqv, 0, 2, 1, 3)
        return gg.cont(c, cur, hv * hp.n_head, s.n_tokens)

    def output(self, weight: Tensor, cur: Tensor) -> Tensor | None:
        """The output layer, the logits W cur, when the graph gives logits (inference). A
        training window's graph leaves the layer to its loss, which computes it a chunk of
        the vocabulary at a time (ggmlpy's linear_cross_entropy): `head` records (W, cur)
        and there are no logits (None). An architecture whose logits are more than this
        product (a final softcap) builds them itself and calls `finish`; its training loss
        then takes the whole logits."""
        if not self.logits_out:
            self.head = (weight, cur)
            return None
        self.hidden_states(cur)
        return self.finish(gg.mul_mat(self.ctx, weight, cur))

    def hidden_states(self, cur: Tensor) -> Tensor:
        """Record `cur`, the output layer's input (the last hidden states after the output
        norm), as the embeddings; they leave the graph when the shape asks for embeddings (an
        architecture building its own logits calls this before `finish`)."""
        self.embd = cur
        if self.shape.embeddings:
            cur.set_name("result_norm")
            cur.set_output()
            self.graph.visit(cur)
        return cur

    def finish(self, logits: Tensor) -> Tensor:
        logits.set_name("result_output")
        if self.logits_out:
            logits.set_output()
            self.graph.visit(logits)
        self.logits = logits
        return logits
