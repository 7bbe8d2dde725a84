"""Flash attention for small heads (head size <= 32: stories260K's 8, toy and test models).

ggml's own kernels (attention.py) work one head and one query row (or tile of 64 rows) at a
time, with the head's dot products as vector lanes: for a head of 8 values that leaves most
of every vector empty and the per-task cost dominant (stories260K's perplexity ran at 0.70x
this kernel's speed through them, 0.37x at -ub 32). From 64 values up, ggml's kernels fill
their vectors and are what llama.cpp computes. Here a task is Q_TILE queries of one
sequence for every head, the queries are the vector lanes, and the head size is a
compile-time constant (the length of a tuple argument), so the loops over it unroll.

Numerics: ggml's tiled kernel's arithmetic in a fixed order that does not depend on the
ubatch — float32 scores and outputs summed in order over the head and the cells, the
softmax sum in double, normalised at the end — so n_ubatch and the thread count change no
bit. (ggml's one-chunk kernel, which it takes under 64 query rows, sums in F16; for small
heads the difference is ~3e-5 of a perplexity, tests/test_perplexity.py.)
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kernels import alibi_slope, exp_f32

F32 = np.float32
MAX_HEAD_DIM = 32  # head sizes unrolled at compile time; wider heads go to attention.py
Q_TILE = 32  # query rows attended together: the vector width of the attention loops
_F32_MAX = F32(np.finfo(np.float32).max)

# The loops are compiled with fused multiply-adds; nothing is reassociated, every sum stays in order.
_FMA = {"contract"}


@njit(cache=True)
def _attn_mask_tile(mask, q0, nt, mt):
    """mt[j, i] = mask[q0 + i, j] for the tile's nt queries over its span [lo, hi) of cells
    that some of them sees (beyond it every weight is exactly 0)."""
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


KV_BLOCK = 8  # cells per pass over the output accumulator in _attn_pv


@njit(cache=True, fastmath=_FMA)
def _attn_pv(p, vh, acc, lo, hi, width, dv_dims):
    """acc[d, i] = sum over cells j in [lo, hi) of p[j, i] * vh[j, d] for the tile's first
    `width` queries, summed in order of j.
    KV_BLOCK cells per read/write of the accumulator, so that its stores, which the compiler
    cannot tell apart from p's loads, are few and the loop over queries vectorises."""
    dv = len(dv_dims)
    for d in range(dv):  # loops, not slice assignments: those cost numba seconds to compile
        for i in range(width):
            acc[d, i] = 0.0
    n_blocks = (hi - lo) // KV_BLOCK
    for b in range(n_blocks):
        j0 = lo + b * KV_BLOCK
        for d in range(dv):
            a_d = acc[d]
            for i in range(width):
                a = a_d[i]
                for jj in range(KV_BLOCK):
                    a += p[j0 + jj, i] * vh[j0 + jj, d]
                a_d[i] = a
    for j in range(lo + n_blocks * KV_BLOCK, hi):
        for d in range(dv):
            a_d = acc[d]
            vd = vh[j, d]
            for i in range(width):
                a_d[i] += p[j, i] * vd


@njit(cache=True, inline="always")
def _attn_dot(kj, qt, i, dk_dims):
    """q_i . k_j, summed in order of the head dimension (qt holds the tile's queries by column)."""
    a = F32(0.0)
    for d in range(len(dk_dims)):
        a += kj[d] * qt[d, i]
    return a


@njit(cache=True, fastmath=_FMA)
def _attn_scores_softcap(k, i3, hk, qt, mth, st, mx, lo, hi, sc, cap, slope, dk_dims, tile):
    """flash_attn_f32's score pass with a logit softcap: tanh(q.k * sc) * cap + slope * mask (sc: scale / cap)."""
    for j in range(lo, hi):
        kj = k[i3, j, hk]
        s = st[j]
        mj = mth[j]
        for i in range(tile):
            s[i] = np.tanh(_attn_dot(kj, qt, i, dk_dims) * sc) * cap + slope * mj[i]
        for i in range(tile):
            mx[i] = np.maximum(mx[i], s[i])


@njit(parallel=True, cache=True, fastmath=_FMA)
def flash_attn_f32(q, k, v, mask, dst, scale, max_bias, softcap, has_mask, dk_dims, dv_dims, tile):
    """dst = softmax(q.k * scale [softcapped] + slope * mask) . v per query row, as ggml's
    tiled CPU kernel: float32 products, the softmax sum in double, normalised at the end.

    q: [n3, n_head, n_q, dk], k/v: [n3, n_kv, n_head_kv, dk/dv] (the KV cache's memory order),
    mask: [m3, m2, >= n_q, n_kv],
    dst: [n3, n_q, n_head, dv]. A task is Q_TILE queries of one sequence, for every head;
    the inner loops run over the tile's queries (vectorised, each query's sums in plain
    sequential order), only as many as the tile has (one for a decode step). `tile` must be
    Q_TILE: it comes at run time only so that LLVM keeps the loops over it as vector loops
    (given the constant 32, it unrolls them into scalar code, 20% slower). The head sizes arrive as the lengths of tuples (dk_dims, dv_dims),
    which are part of the type, so numba compiles them as constants and the loops over them
    unroll. Only the tile's span of unmasked cells is computed.
    """
    dk, dv = len(dk_dims), len(dv_dims)
    n3, n_head, n_q = q.shape[0], q.shape[1], q.shape[2]
    n_kv, n_head_kv = k.shape[1], k.shape[2]
    group = n_head // n_head_kv
    m3, m2 = mask.shape[0], mask.shape[1]
    sc = F32(scale / softcap) if softcap != 0.0 else F32(scale)  # ggml's softcap: cap * tanh(s * scale / cap)
    cap = F32(softcap)
    n_tiles = (n_q + Q_TILE - 1) // Q_TILE
    for task in prange(n3 * n_tiles):
        i3 = task // n_tiles
        u = task % n_tiles
        t = u // 2 if u % 2 == 0 else n_tiles - 1 - u // 2  # big and small tiles alternate: even halves
        q0 = t * Q_TILE
        nt = min(Q_TILE, n_q - q0)
        w = min(tile, nt)  # the lanes worth computing: all of a full tile, one for a decode
        if has_mask:
            mt = np.empty((m2, n_kv, Q_TILE), dtype=np.float32)
        else:
            mt = np.zeros((m2, n_kv, Q_TILE), dtype=np.float32)  # added as a mask, changes nothing
        spans = np.empty((m2, 2), dtype=np.int64)
        for i2 in range(m2):
            if has_mask:
                spans[i2, 0], spans[i2, 1] = _attn_mask_tile(mask[i3 % m3, i2], q0, nt, mt[i2])
            else:
                spans[i2, 0], spans[i2, 1] = 0, n_kv
        qt = np.zeros((dk, Q_TILE), dtype=np.float32)
        st = np.empty((n_kv, Q_TILE), dtype=np.float32)
        acc = np.empty((dv, Q_TILE), dtype=np.float32)
        mx = np.empty(Q_TILE, dtype=np.float32)
        sm = np.empty(Q_TILE, dtype=np.float64)
        for h in range(n_head):
            hk = h // group
            mth = mt[h % m2]
            lo, hi = spans[h % m2, 0], spans[h % m2, 1]
            slope = alibi_slope(max_bias, h, n_head)
            for d in range(dk):
                for i in range(nt):
                    qt[d, i] = q[i3, h, q0 + i, d]
            # a query that sees no cell keeps -max: its weights exp(-inf) are 0, its output 0 (as ggml)
            for i in range(Q_TILE):
                mx[i] = -_F32_MAX
            if softcap == 0.0:
                for j in range(lo, hi):
                    kj = k[i3, j, hk]
                    s = st[j]
                    mj = mth[j]
                    for i in range(w):  # score, mask and running max in one pass
                        a = _attn_dot(kj, qt, i, dk_dims) * sc + slope * mj[i]
                        s[i] = a
                        mx[i] = np.maximum(mx[i], a)  # not max(): that compiles to masked stores, slow on AMD
            else:
                _attn_scores_softcap(k, i3, hk, qt, mth, st, mx, lo, hi, sc, cap, slope, dk_dims, w)
            for i in range(Q_TILE):
                sm[i] = 0.0
            for j in range(lo, hi):
                s = st[j]
                for i in range(w):
                    s[i] = exp_f32(s[i] - mx[i])
                for i in range(w):
                    sm[i] += np.float64(s[i])
            _attn_pv(st, v[i3, :, hk], acc, lo, hi, w, dv_dims)
            for i in range(nt):
                inv = F32(0.0) if sm[i] == 0.0 else F32(1.0 / sm[i])
                for d in range(dv):
                    dst[i3, q0 + i, h, d] = acc[d, i] * inv

