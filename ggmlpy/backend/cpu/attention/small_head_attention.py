"""Flash attention for small heads (head size <= 32: stories260K's 8, toy and test models).

attention.py follows ggml's kernels task for task: one head and a tile of 64 query rows (or
one row) at a time, the head's dot products as the vector lanes. For a head of 8 values
that leaves most of every vector empty and the per-task cost dominant (stories260K's
perplexity ran at 0.70x this module's speed through them, 0.37x at -ub 32). Here a task is
Q_TILE queries of one sequence for every head, the queries are the vector lanes, and the
head size is a compile-time constant (the length of a tuple argument), so the loops over it
unroll.

Numerics: ggml's tiled kernel's, rounding for rounding, for every ubatch size (so n_ubatch
and the thread count change no bit): per tile of 64 cells, scores by fma chains over the
head, then scale, softcap and mask; the tile's max, the running max and sum rescaled with
expf, the weights by ggml_v_expf and their sum in double over 16-lane reductions, V
accumulated by fma chains over the cells; normalised at the end. Each query row's result
depends only on itself, so the 32 lanes here give what ggml's 64-row tiles give. (Under 64
query rows llama.cpp takes its one-chunk kernel, which sums in F16: ~3e-5 of a perplexity.)
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ....llvmir.attention import LANES, lanes_scores, lanes_values
from ....llvmir.scalar import fma_f32
from ..rows.kernels import alibi_slope
from ..simd import expf, expf_avx512
from .attention import KV_TILE, softcap_scales

F32 = np.float32
MAX_HEAD_DIM = 32  # head sizes unrolled at compile time; wider heads go to attention.py
Q_TILE = LANES  # query rows attended together: the vector kernels' lanes


@njit(cache=True)
def _attn_mask_tile(mask, q0, nt, mt):
    """mt[j, i] = mask[q0 + i, j] for the tile's nt queries over its span [lo, hi) of cells
    that some of them sees (outside it every weight is exactly 0)."""
    n_kv = mask.shape[1]
    lo, hi = n_kv, 0
    for i in range(nt):
        row = mask[q0 + i]
        j = 0
        while j < lo and row[j] == -np.inf:
            j += 1
        lo = min(lo, j)
        j = n_kv
        while j > hi and row[j - 1] == -np.inf:
            j -= 1
        hi = max(hi, j)
    for j in range(lo, hi):
        for i in range(nt):
            mt[j, i] = mask[q0 + i, j]
    return lo, max(lo, hi)


@njit(cache=True, inline="always")
def _reduce16_lane(p, o, i):
    """simd.reduce16 of p[o..o + 15, i]: _mm512_reduce_add_ps's order."""
    u0 = (p[o, i] + p[o + 8, i]) + (p[o + 4, i] + p[o + 12, i])
    u1 = (p[o + 1, i] + p[o + 9, i]) + (p[o + 5, i] + p[o + 13, i])
    u2 = (p[o + 2, i] + p[o + 10, i]) + (p[o + 6, i] + p[o + 14, i])
    u3 = (p[o + 3, i] + p[o + 11, i]) + (p[o + 7, i] + p[o + 15, i])
    return (u0 + u2) + (u1 + u3)


@njit(cache=True, inline="always")
def _score(k, k3, j, hk, qt, i, dk_dims):
    """q_i . k_j as ggml's tiled kernel sums it: an fma chain over the head."""
    x = F32(0.0)
    for d in range(len(dk_dims)):
        x = fma_f32(k[k3, j, hk, d], qt[d, i], x)
    return x


@njit(cache=True)
def _attn_head(q, k, v, mt, dst, i3, h, hk, q0, w, lo, hi, sc, cap, slope, has_mask,
               qt, s, acc, mx, sm, tm, sd, dk_dims, dv_dims):
    """One head of one tile of w queries: dst[i3, q0 + i, h] for i < w. Every loop over the
    queries is a vector loop, and there are few per cell: their set-up is the cost here."""
    dk, dv = len(dk_dims), len(dv_dims)
    k3, v3 = i3 % k.shape[0], i3 % v.shape[0]
    for d in range(dk):
        for i in range(w):
            qt[d, i] = q[i3, h, q0 + i, d]
    for d in range(dv):
        for i in range(Q_TILE):  # every lane: the vector kernels compute them all
            acc[d, i] = 0.0
    for i in range(w):
        mx[i] = -np.inf
        sm[i] = 0.0
    for c0 in range(lo - lo % KV_TILE, hi, KV_TILE):  # ggml's tiles of cells; the ones no query sees add nothing
        a, b = max(lo, c0) - c0, min(hi, c0 + KV_TILE) - c0  # the tile's cells some query sees
        for i in range(Q_TILE):
            tm[i] = -np.inf
        if cap == 0.0:  # scores: fma chains over the head, scale, mask; the tile's max
            lanes_scores(k[k3, c0:, hk], qt, mt[c0:], s, tm, a, b, sc, slope, has_mask)
        else:  # with ggml's softcap (tanhf: a call)
            for c in range(a, b):
                j = c0 + c
                for i in range(w):
                    s[c, i] = F32(np.tanh(_score(k, k3, j, hk, qt, i, dk_dims) * sc)) * cap
                if has_mask:
                    for i in range(w):
                        s[c, i] = s[c, i] + slope * mt[j, i]
                for i in range(w):
                    tm[i] = tm[i] if tm[i] > s[c, i] else s[c, i]
        for i in range(w):  # the running max and sum rescaled; a query that sees nothing here: no change
            if tm[i] > mx[i]:
                ms = expf(mx[i] - tm[i])
                for d in range(dv):
                    acc[d, i] = acc[d, i] * ms
                sm[i] = sm[i] * ms
                mx[i] = tm[i]
            tm[i] = mx[i] if tm[i] != -np.inf else F32(0.0)  # exp(-inf - 0) = 0: weights 0
            sd[i] = 0.0
        for c in range(a, b):  # the weights: ggml_v_expf
            for i in range(w):
                s[c, i] = expf_avx512(s[c, i] - tm[i])
        g0, g1 = a - a % 16, min(KV_TILE, b + (-b) % 16)  # the 16-cell groups the cells fall in
        for c in range(g0, a):  # their other cells weigh 0
            for i in range(w):
                s[c, i] = 0.0
        for c in range(b, g1):
            for i in range(w):
                s[c, i] = 0.0
        for o in range(g0, g1, 16):  # the sum: 16-lane reductions added in double (the groups left out add 0)
            for i in range(w):
                sd[i] += np.float64(_reduce16_lane(s, o, i))
        for i in range(w):
            sm[i] = F32(np.float64(sm[i]) + sd[i])
        lanes_values(s, v[v3, c0:, hk], acc, a, b)  # output: fma chains over the cells (the others' weights are 0)
    for i in range(w):
        inv = F32(0.0) if sm[i] == 0.0 else F32(1.0) / sm[i]
        for d in range(dv):
            dst[i3, q0 + i, h, d] = acc[d, i] * inv


@njit(parallel=True, cache=True)
def flash_attn_f32(q, k, v, mask, dst, scale, max_bias, softcap, has_mask, dk_dims, dv_dims):
    """dst = softmax(q.k * scale [softcapped] + slope * mask) . v per query row, in ggml's
    tiled kernel's arithmetic (module docstring).

    q: [n3, n_head, n_q, dk], k/v: [n3, n_kv, n_head_kv, dk/dv] (the KV cache's memory order),
    mask: [m3, m2, >= n_q, n_kv], dst: [n3, n_q, n_head, dv]. A task is Q_TILE queries of one
    sequence, for every head; its inner loops are llvmir/attention.py's lane kernels. The
    head sizes arrive as the lengths of tuples (dk_dims, dv_dims), which are part of the
    type, so numba compiles them as constants. Only the cells some query of a tile sees are
    read.
    """
    dk, dv = len(dk_dims), len(dv_dims)
    n3, n_head, n_q = q.shape[0], q.shape[1], q.shape[2]
    n_kv, n_head_kv = k.shape[1], k.shape[2]
    group = n_head // n_head_kv
    m3, m2 = mask.shape[0], mask.shape[1]
    sc, cap = softcap_scales(scale, softcap)
    n_tiles = (n_q + Q_TILE - 1) // Q_TILE
    for task in prange(n3 * n_tiles):
        i3 = task // n_tiles
        u = task % n_tiles
        t = u // 2 if u % 2 == 0 else n_tiles - 1 - u // 2  # big and small tiles alternate: even halves
        q0 = t * Q_TILE
        w = min(Q_TILE, n_q - q0)  # the tile's queries: Q_TILE, or fewer in the last (one for a decode)
        mt = np.zeros((m2, n_kv if has_mask else 1, Q_TILE), dtype=np.float32)  # lanes past the tile's queries: 0
        spans = np.empty((m2, 2), dtype=np.int64)
        for i2 in range(m2):
            if has_mask:
                spans[i2, 0], spans[i2, 1] = _attn_mask_tile(mask[i3 % m3, i2], q0, w, mt[i2])
            else:
                spans[i2, 0], spans[i2, 1] = 0, n_kv
        qt = np.zeros((dk, Q_TILE), dtype=np.float32)
        s = np.zeros((KV_TILE, Q_TILE), dtype=np.float32)
        acc = np.empty((dv, Q_TILE), dtype=np.float32)
        mx = np.empty(Q_TILE, dtype=np.float32)
        sm = np.empty(Q_TILE, dtype=np.float32)
        tm = np.empty(Q_TILE, dtype=np.float32)
        sd = np.empty(Q_TILE, dtype=np.float64)
        for h in range(n_head):
            _attn_head(q, k, v, mt[h % m2], dst, i3, h, h // group, q0, w, spans[h % m2, 0], spans[h % m2, 1],
                       sc, cap, alibi_slope(max_bias, h, n_head), has_mask, qt, s, acc, mx, sm, tm, sd, dk_dims, dv_dims)
