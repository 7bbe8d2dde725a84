"""FLASH_ATTN_EXT as ggml-cpu computes it (ops.cpp), rounding for rounding (simd.py).

ggml has two kernels and picks one per op, so the number of query rows in a ubatch
(n_ubatch) selects the numerics, in ggml and here alike:

  tiled      64 query rows or more, K and V both F16 or both F32: float32 Q; per tile of 64
             cells, scores by fma chains over the head dimension, the tile's softmax with
             ggml_v_expf and its sum in double, the running max/sum rescaled with expf, V
             accumulated by fma chains over the cells (simd_gemm); each query row depends
             only on itself, so the tile of rows it shares does not matter.
  one-chunk  fewer rows (generation, short prompts): cell by cell online softmax, Q rounded
             to the K type's vec_dot type (F16 for an F16 cache), scores by
             ggml_vec_dot_f16 (4 x 16 lanes, reduced as ggml), and for an F16 V the output
             accumulated in F16 (each step rounded to half: ggml_vec_mad_f16, _scale_f16).

An F32 K's scores are ggml_vec_dot_f32, its tail as GCC compiles it (llvmir/float_dots.py;
numba caches these kernels by this file's date, not llvmir's: change both together).

Not reproduced: ggml's split-KV path for one query row over 512 cells or more, whose
partial sums depend on the thread count (here: the one-chunk kernel), and K/V types other
than F16/F32 (converted to float32 and treated as F32).

Arrays: q [n3, n_head, n_q, dk] float32; k, v [n3k, n_kv, n_head_kv, d] float32 values
(an F16 cache converted exactly; `half_k`, `half_v` say which are halves; the one-chunk
kernel also takes an F16 cache's bits, uint16, and converts a cell as it reads it); mask
[m3, m2, >= n_q, n_kv] float32; dst [n3, n_q, n_head, dv].
"""
from __future__ import annotations


import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ....half import f16_bits_to_f32, f32_to_f16_bits
from ....llvmir.attention import attn_scores_4x64, attn_values_4x64
from ....llvmir.float_dots import vec_dot_f16_row, vec_dot_f32_row
from ....llvmir.scalar import fma_f32
from ..rows.kernels import alibi_slope
from ..simd import expf, expf_avx512, reduce16

F32 = np.float32
Q_TILE = 64   # ggml_fa_tile_config::Q: rows from which ggml uses the tiled kernel
KV_TILE = 64  # ggml_fa_tile_config::KV


@njit(cache=True, inline="always")
def _half(x):
    return f16_bits_to_f32(f32_to_f16_bits(x))


@njit(cache=True, inline="always")
def _score_post(s, scale, softcap):
    """s * scale, then softcap * tanh (scale already divided by softcap, as ggml)."""
    s = s * scale
    if softcap != 0.0:
        s = F32(np.tanh(s)) * softcap
    return s


@njit(cache=True, inline="always")
def softcap_scales(scale, softcap):
    """The scale applied before the softcap and the cap (0: none): ggml computes
    cap * tanh(s * scale / cap), or s * scale without a cap."""
    return (F32(scale / softcap) if softcap != 0.0 else F32(scale)), F32(softcap)


@njit(parallel=True, cache=True)
def flash_attn_tiled(q, k, v, mask, dst, scale, max_bias, softcap, has_mask):
    """ggml_compute_forward_flash_attn_ext_tiled: a task is a tile of 64 query rows of one head."""
    n3, n_head, n_q, dk = q.shape
    n_kv, n_head_kv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = n_head // n_head_kv
    m3, m2 = mask.shape[0], mask.shape[1]
    sc, cap = softcap_scales(scale, softcap)
    n_tiles = (n_q + Q_TILE - 1) // Q_TILE
    for task in prange(n3 * n_head * n_tiles):
        i3 = task // (n_head * n_tiles)
        h = (task // n_tiles) % n_head
        q0 = (task % n_tiles) * Q_TILE
        rows = min(Q_TILE, n_q - q0)
        hk = h // group
        k3, v3 = i3 % k.shape[0], i3 % v.shape[0]
        slope = alibi_slope(max_bias, h, n_head)
        kt = np.zeros((dk, KV_TILE), dtype=np.float32)
        vt = np.zeros((KV_TILE, dv), dtype=np.float32)
        kq = np.zeros((Q_TILE, KV_TILE), dtype=np.float32)
        mt = np.zeros((Q_TILE, KV_TILE), dtype=np.float32)
        vkq = np.zeros((Q_TILE, dv), dtype=np.float32)
        mx = np.full(Q_TILE, -np.inf, dtype=np.float32)
        sm = np.zeros(Q_TILE, dtype=np.float32)
        skip = np.zeros(Q_TILE, dtype=np.bool_)
        qt = np.zeros((Q_TILE, dk), dtype=np.float32)
        for r in range(rows):
            for d in range(dk):
                qt[r, d] = q[i3, h, q0 + r, d]
        for c0 in range(0, n_kv, KV_TILE):
            cells = min(KV_TILE, n_kv - c0)
            if has_mask:  # the mask tile (slope * mask); a tile no row of the tile sees is skipped
                seen = False
                mrow = mask[i3 % m3, h % m2]
                for r in range(rows):
                    for c in range(cells):
                        a = slope * mrow[q0 + r, c0 + c]
                        mt[r, c] = a
                        if a != -np.inf:
                            seen = True
                    for c in range(cells, KV_TILE):
                        mt[r, c] = -np.inf
                if not seen:
                    continue
            for c in range(cells):  # K tile transposed, zero-padded past the last cell
                for d in range(dk):
                    kt[d, c] = k[k3, c0 + c, hk, d]
            full = rows - rows % 4
            for r0 in range(0, full, 4):  # scores: fma chains over the head dimension, 4 rows at a time
                attn_scores_4x64(kt, qt, kq, r0, dk)
            for r in range(full, rows):
                a0 = kq[r]
                a0[:] = 0.0
                for d in range(dk):
                    b0 = qt[r, d]
                    ktd = kt[d]
                    for c in range(KV_TILE):
                        a0[c] = fma_f32(ktd[c], b0, a0[c])
            for r in range(rows):  # scale, softcap, mask; then the tile's online softmax
                kr = kq[r]
                for c in range(KV_TILE):
                    kr[c] = _score_post(kr[c], sc, cap)
                for c in range(cells, KV_TILE):
                    kr[c] = -np.inf
                if has_mask:
                    for c in range(KV_TILE):
                        kr[c] = kr[c] + mt[r, c]
                tmax = F32(-np.inf)
                for c in range(KV_TILE):
                    tmax = max(tmax, kr[c])
                skip[r] = tmax == -np.inf
                if skip[r]:
                    continue
                mnew = max(mx[r], tmax)
                if mnew > mx[r]:
                    ms = expf(mx[r] - mnew)
                    for d in range(dv):
                        vkq[r, d] = vkq[r, d] * ms
                    sm[r] = sm[r] * ms
                mx[r] = mnew
                total = 0.0
                for c in range(KV_TILE):
                    kr[c] = expf_avx512(kr[c] - mnew)
                for c in range(0, KV_TILE, 16):
                    total += np.float64(reduce16(kr, c))
                sm[r] = F32(np.float64(sm[r]) + total)
            for c in range(cells):  # V tile, zero-padded
                for d in range(dv):
                    vt[c, d] = v[v3, c0 + c, hk, d]
            for c in range(cells, KV_TILE):
                vt[c, :] = 0.0
            for r in range(rows):  # rows that see nothing here take 0 * V: no change
                if skip[r]:
                    kq[r, :] = 0.0
            for r0 in range(0, full, 4):  # output: fma chains over the tile's cells, 4 rows at a time
                for d0 in range(0, dv - dv % 64, 64):
                    attn_values_4x64(vt, kq, vkq, r0, d0)
                o0, o1, o2, o3 = vkq[r0], vkq[r0 + 1], vkq[r0 + 2], vkq[r0 + 3]
                for c in range(KV_TILE):
                    p0, p1, p2, p3 = kq[r0, c], kq[r0 + 1, c], kq[r0 + 2, c], kq[r0 + 3, c]
                    vc = vt[c]
                    for d in range(dv - dv % 64, dv):
                        vd = vc[d]
                        o0[d] = fma_f32(vd, p0, o0[d])
                        o1[d] = fma_f32(vd, p1, o1[d])
                        o2[d] = fma_f32(vd, p2, o2[d])
                        o3[d] = fma_f32(vd, p3, o3[d])
            for r in range(full, rows):
                o0 = vkq[r]
                for c in range(KV_TILE):
                    p0 = kq[r, c]
                    vc = vt[c]
                    for d in range(dv):
                        o0[d] = fma_f32(vc[d], p0, o0[d])
        for r in range(rows):
            inv = F32(0.0) if sm[r] == 0.0 else F32(1.0) / sm[r]
            for d in range(dv):
                dst[i3, q0 + r, h, d] = vkq[r, d] * inv


def cell_values(row, buf):
    """A K or V cell's values as float32: the row itself, or an F16 cache's bits converted
    into `buf` (numba picks by the row's type: see the overload below)."""
    raise NotImplementedError("called from numba code only")


@overload(cell_values, inline="always")
def _cell_values(row, buf):
    if row.dtype == types.uint16:
        def convert(row, buf):
            for d in range(row.shape[0]):
                buf[d] = f16_bits_to_f32(row[d])
            return buf
        return convert
    return lambda row, buf: row


@njit(parallel=True, cache=True)
def flash_attn_one_chunk(q, k, v, mask, dst, scale, max_bias, softcap, has_mask, half_k, half_v):
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk: one task per (query row, head)."""
    n3, n_head, n_q, dk = q.shape
    n_kv, n_head_kv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = n_head // n_head_kv
    m3, m2 = mask.shape[0], mask.shape[1]
    sc, cap = softcap_scales(scale, softcap)
    for task in prange(n3 * n_head * n_q):
        i3 = task // (n_head * n_q)
        h = (task // n_q) % n_head
        iq = task % n_q
        hk = h // group
        k3, v3 = i3 % k.shape[0], i3 % v.shape[0]
        slope = alibi_slope(max_bias, h, n_head)
        qv = np.empty(dk, dtype=np.float32)
        for d in range(dk):  # Q as the vec_dot type of K: half for an F16 cache
            qv[d] = _half(q[i3, h, iq, d]) if half_k else q[i3, h, iq, d]
        vkq = np.zeros(dv, dtype=np.float32)  # float32 values; halves when V is F16
        kbuf = np.empty(dk, dtype=np.float32)   # a cell of an F16 cache read in place, as float32
        vbuf = np.empty(dv, dtype=np.float32)
        mx = F32(-np.inf)
        sm = F32(0.0)
        for ic in range(n_kv):
            mv = slope * mask[i3 % m3, h % m2, iq, ic] if has_mask else F32(0.0)
            if mv == -np.inf:
                continue
            kc = cell_values(k[k3, ic, hk], kbuf)
            s = vec_dot_f16_row(kc, qv, dk) if half_k else vec_dot_f32_row(kc, qv, dk)  # kc, qv contiguous
            s = _score_post(s, sc, cap) + mv
            ms = F32(1.0)
            vs = F32(1.0)
            vc = cell_values(v[v3, ic, hk], vbuf)
            if s > mx:
                ms = expf(mx - s)
                mx = s
                for d in range(dv):
                    vkq[d] = _half(vkq[d] * ms) if half_v else vkq[d] * ms
            else:
                vs = expf(s - mx)
            for d in range(dv):
                vkq[d] = _half(fma_f32(vc[d], vs, vkq[d])) if half_v else fma_f32(vc[d], vs, vkq[d])
            sm = fma_f32(sm, ms, vs)
        inv = F32(0.0) if sm == 0.0 else F32(1.0) / sm
        for d in range(dv):
            dst[i3, iq, h, d] = vkq[d] * inv
