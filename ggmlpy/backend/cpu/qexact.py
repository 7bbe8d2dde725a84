"""Products with block-quantized matrices in ggml-cpu's own summation order.

ggml quantizes the activations to the matrix type's vec_dot_type (Q8_0, Q8_K) and sums
integer products per group of elements; those sums are exact. What it rounds is the float
arithmetic around them, in an order each kernel fixes, and that order is reproduced here
(simd.py says why it matters):

  Q5_0, Q8_0 (x Q8_0)   ggml_vec_dot_q*_0_q8_0 and llamafile's tinyBLAS_Q0_AVX (any number
                        of columns): per 32-block b, 8 lanes of 4 products each,
                        lane_j = fma(d_w[b] * d_x[b], isum[b, j], lane_j), then hsum8.
  Q4_K (x Q8_K)         the 8x8-repacked kernels every Q4_K matrix with rows % 8 == 0 gets
                        on x86: tokens in groups of 4 through ggml_gemm_q4_K_8x8_q8_K (per
                        64-element chunk c: acc = fma(isum_c, d_w * d_x, acc), the mins in a
                        second sum, acc - acc_min), the last tokens % 4 through the gemv
                        (the same per super-block instead of per chunk).
  Q6_K (x Q8_K)         8 columns or more: the tiled kernel (ggml-cpu/tiled): per super-block
                        acc = fma(f(isum) * d_w, d_x, acc); fewer: ggml_vec_dot_q6_K_q8_K
                        (8 lanes over ggml's mix of elements and scales, then hsum8).

The integer sums are computed as float32 where every partial sum is below 2^24 in magnitude
(exact in any order, so the loops vectorise), else in float64. Other types go through
qmatmul's tiles.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...quants.common import F32, QK_K, f16_to_f32, nearest_int
from ...quants.kquants import _scale_min_k4
from ...quants.simple import activation_block_scale
from ...types import GGMLType
from .simd import fma_f32, hsum8

QK = 32
GEMM_ROWS = 8      # matrix rows a Q0 task multiplies at once (their lane sums share the column loads)
GEMM_COLS = 256    # columns per task: the block unpacking of its rows is shared by all of them


# ---- activations -------------------------------------------------------------------------
@njit(parallel=True, cache=True)
def quantize_q8_0_lanes(x, xq, xd):
    """x (N, K) -> its Q8_0 integers as float32 in lane order, xq[b, t, j, n] = q of element
    32b + 4j + t of row n, and the block scales xd[b, n] (fp16 values), as ggml-cpu's
    quantize_row_q8_0 rounds them (round half to even of x * 127 / amax)."""
    nb = x.shape[1] // QK
    for n in prange(x.shape[0]):
        xr = x[n]
        for b in range(nb):
            d, idd = activation_block_scale(xr, b * QK)
            xd[b, n] = d
            for j in range(8):
                for t in range(4):
                    xq[b, t, j, n] = np.rint(F32(xr[b * QK + 4 * j + t] * idd))


@njit(cache=True, inline="always")
def _signed_absmax(x, o, n):
    amax = F32(0.0)
    mx = F32(0.0)
    for j in range(n):
        v = x[o + j]
        if amax < abs(v):
            amax = abs(v)
            mx = v
    return amax, mx


@njit(parallel=True, cache=True)
def quantize_q8_k_cols(x, xq, xd, bsums):
    """x (N, K) -> Q8_K as quantize_row_q8_K (= its _ref on x86): xq[k, n] the integers as
    float32 (element k of row n), xd[i, n] the float32 scale of super-block i, bsums[s, n]
    the integer sum of the 16 integers of sub-block s."""
    nb = x.shape[1] // QK_K
    for n in prange(x.shape[0]):
        xr = x[n]
        for i in range(nb):
            xo = i * QK_K
            amax, mx = _signed_absmax(xr, xo, QK_K)
            if amax == 0:
                xd[i, n] = F32(0.0)
                for j in range(QK_K):
                    xq[xo + j, n] = F32(0.0)
                for s in range(16):
                    bsums[i * 16 + s, n] = 0
                continue
            iscale = F32(-127.0) / mx
            for s in range(16):
                tot = 0
                for j in range(16):
                    q = min(127, nearest_int(iscale * xr[xo + 16 * s + j]))
                    xq[xo + 16 * s + j, n] = F32(q)
                    tot += q
                bsums[i * 16 + s, n] = tot
            xd[i, n] = F32(F32(1.0) / iscale)


# ---- Q5_0, Q8_0 --------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _u32(buf, o):
    return (np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8)
            | (np.int64(buf[o + 2]) << 16) | (np.int64(buf[o + 3]) << 24))


@njit(cache=True, inline="always")
def _unpack_q0_block(buf, o, is_q8, w, r):
    """Block at buf[o] (Q5_0 or Q8_0) -> w[r, t, j] = its integer 4j + t (float32); its d."""
    if is_q8:
        for j in range(8):
            for t in range(4):
                w[r, t, j] = F32(np.int8(buf[o + 2 + 4 * j + t]))
    else:
        qh = _u32(buf, o + 2)
        for j in range(8):
            for t in range(4):
                e = 4 * j + t
                q = np.int32(buf[o + 6 + (e & 15)])
                nib = (q & 0xF) if e < 16 else (q >> 4)
                w[r, t, j] = F32((nib | (np.int32((qh >> e) & 1) << 4)) - 16)
    return f16_to_f32(buf[o], buf[o + 1])


@njit(parallel=True, cache=True, fastmath={"contract"})
def _mul_mat_q0(buf, offs, block_bytes, is_q8, xq, xd, out):
    """out[n, m] = ggml's Q5_0/Q8_0 x Q8_0 dot product of row m and column n (module doc).

    A task is GEMM_ROWS rows by up to GEMM_COLS columns; per block b it unpacks its rows'
    integers, then for each lane j runs over the columns (the vector loop) accumulating
    the 8 rows' lane sums, each an exact 4-term integer sum, into their fma chains."""
    m_rows = offs.shape[0]
    nb, n_cols = xq.shape[0], xq.shape[3]
    row_tasks = (m_rows + GEMM_ROWS - 1) // GEMM_ROWS
    col_tasks = (n_cols + GEMM_COLS - 1) // GEMM_COLS
    for task in prange(row_tasks * col_tasks):
        m0 = (task // col_tasks) * GEMM_ROWS
        n0 = (task % col_tasks) * GEMM_COLS
        nn = min(GEMM_COLS, n_cols - n0)
        acc = np.zeros((GEMM_ROWS, 8, nn), dtype=np.float32)
        s = np.empty((GEMM_ROWS, nn), dtype=np.float32)
        w = np.empty((GEMM_ROWS, 4, 8), dtype=np.float32)
        for b in range(nb):
            for r in range(GEMM_ROWS):
                m = min(m0 + r, m_rows - 1)  # rows past the end repeat the last (not stored)
                dw = _unpack_q0_block(buf, offs[m] + b * block_bytes, is_q8, w, r)
                sr = s[r]
                xdb = xd[b, n0:n0 + nn]
                for i in range(nn):
                    sr[i] = dw * xdb[i]
            for j in range(8):
                x0 = xq[b, 0, j, n0:n0 + nn]
                x1 = xq[b, 1, j, n0:n0 + nn]
                x2 = xq[b, 2, j, n0:n0 + nn]
                x3 = xq[b, 3, j, n0:n0 + nn]
                for r in range(0, GEMM_ROWS, 4):
                    a0, a1, a2, a3 = acc[r, j], acc[r + 1, j], acc[r + 2, j], acc[r + 3, j]
                    s0, s1, s2, s3 = s[r], s[r + 1], s[r + 2], s[r + 3]
                    w00, w01, w02, w03 = w[r, 0, j], w[r, 1, j], w[r, 2, j], w[r, 3, j]
                    w10, w11, w12, w13 = w[r + 1, 0, j], w[r + 1, 1, j], w[r + 1, 2, j], w[r + 1, 3, j]
                    w20, w21, w22, w23 = w[r + 2, 0, j], w[r + 2, 1, j], w[r + 2, 2, j], w[r + 2, 3, j]
                    w30, w31, w32, w33 = w[r + 3, 0, j], w[r + 3, 1, j], w[r + 3, 2, j], w[r + 3, 3, j]
                    for i in range(nn):
                        v0, v1, v2, v3 = x0[i], x1[i], x2[i], x3[i]
                        a0[i] = fma_f32(s0[i], w00 * v0 + w01 * v1 + w02 * v2 + w03 * v3, a0[i])
                        a1[i] = fma_f32(s1[i], w10 * v0 + w11 * v1 + w12 * v2 + w13 * v3, a1[i])
                        a2[i] = fma_f32(s2[i], w20 * v0 + w21 * v1 + w22 * v2 + w23 * v3, a2[i])
                        a3[i] = fma_f32(s3[i], w30 * v0 + w31 * v1 + w32 * v2 + w33 * v3, a3[i])
        for r in range(min(GEMM_ROWS, m_rows - m0)):
            a = acc[r]
            for i in range(nn):
                out[n0 + i, m0 + r] = hsum8(a[0, i], a[1, i], a[2, i], a[3, i], a[4, i], a[5, i], a[6, i], a[7, i])


# ---- Q4_K --------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _unpack_q4_k_block(buf, o, w, r):
    """Super-block at buf[o] -> w[r, k] = q_k * scale of its sub-block (float32, <= 945),
    mins[r, s]; returns (d, dmin)."""
    for c in range(4):
        sc1, _ = _scale_min_k4(2 * c, buf, o + 4)
        sc2, _ = _scale_min_k4(2 * c + 1, buf, o + 4)
        qo = o + 16 + 32 * c
        for l in range(32):
            q = np.int32(buf[qo + l])
            w[r, 64 * c + l] = F32((q & 0xF) * sc1)
            w[r, 64 * c + 32 + l] = F32((q >> 4) * sc2)
    return f16_to_f32(buf[o], buf[o + 1]), f16_to_f32(buf[o + 2], buf[o + 3])


@njit(parallel=True, cache=True, fastmath={"contract"})
def _mul_mat_q4_k_gemm(buf, offs, xq, xd, bsums, out, n_gemm):
    """The first n_gemm columns (a multiple of 4): ggml_gemm_q4_K_8x8_q8_K's sums."""
    m_rows = offs.shape[0]
    nb = xq.shape[0] // QK_K
    row_tasks = (m_rows + GEMM_ROWS - 1) // GEMM_ROWS
    col_tasks = (n_gemm + GEMM_COLS - 1) // GEMM_COLS
    for task in prange(row_tasks * col_tasks):
        m0 = (task // col_tasks) * GEMM_ROWS
        n0 = (task % col_tasks) * GEMM_COLS
        nn = min(GEMM_COLS, n_gemm - n0)
        acc = np.zeros((GEMM_ROWS, nn), dtype=np.float32)
        accm = np.zeros((GEMM_ROWS, nn), dtype=np.float32)
        p = np.empty((GEMM_ROWS, nn), dtype=np.float32)
        w = np.empty((GEMM_ROWS, QK_K), dtype=np.float32)
        dw = np.empty(GEMM_ROWS, dtype=np.float32)
        dmw = np.empty(GEMM_ROWS, dtype=np.float32)
        mins = np.empty((GEMM_ROWS, 8), dtype=np.int32)
        for i in range(nb):
            for r in range(GEMM_ROWS):
                m = min(m0 + r, m_rows - 1)
                o = offs[m] + i * 144
                dw[r], dmw[r] = _unpack_q4_k_block(buf, o, w, r)
                for sb in range(8):
                    mins[r, sb] = _scale_min_k4(sb, buf, o + 4)[1]
            xdi = xd[i, n0:n0 + nn]
            for c in range(4):
                p[:] = 0.0
                for k in range(64 * c, 64 * c + 64, 4):  # the chunk's integer sums: exact, any order
                    x0 = xq[i * QK_K + k, n0:n0 + nn]
                    x1 = xq[i * QK_K + k + 1, n0:n0 + nn]
                    x2 = xq[i * QK_K + k + 2, n0:n0 + nn]
                    x3 = xq[i * QK_K + k + 3, n0:n0 + nn]
                    for r in range(GEMM_ROWS):
                        pr = p[r]
                        w0, w1, w2, w3 = w[r, k], w[r, k + 1], w[r, k + 2], w[r, k + 3]
                        for ii in range(nn):
                            pr[ii] += w0 * x0[ii] + w1 * x1[ii] + w2 * x2[ii] + w3 * x3[ii]
                b1 = bsums[i * 16 + 4 * c, n0:n0 + nn]
                b2 = bsums[i * 16 + 4 * c + 1, n0:n0 + nn]
                b3 = bsums[i * 16 + 4 * c + 2, n0:n0 + nn]
                b4 = bsums[i * 16 + 4 * c + 3, n0:n0 + nn]
                for r in range(GEMM_ROWS):
                    m1, m2 = mins[r, 2 * c], mins[r, 2 * c + 1]
                    ar, amr, pr = acc[r], accm[r], p[r]
                    dr, dmr = dw[r], dmw[r]
                    for ii in range(nn):
                        dx = xdi[ii]
                        imin = m1 * (b1[ii] + b2[ii]) + m2 * (b3[ii] + b4[ii])
                        ar[ii] = fma_f32(pr[ii], dr * dx, ar[ii])
                        amr[ii] = fma_f32(F32(imin), dmr * dx, amr[ii])
        for r in range(min(GEMM_ROWS, m_rows - m0)):
            for ii in range(nn):
                out[n0 + ii, m0 + r] = acc[r, ii] - accm[r, ii]


@njit(parallel=True, cache=True)
def _mul_mat_q4_k_gemv(buf, offs, xq, xd, bsums, out, n0):
    """Columns n0.. (fewer than 4): ggml_gemv_q4_K_8x8_q8_K's sums, per super-block."""
    m_rows = offs.shape[0]
    nb = xq.shape[0] // QK_K
    for m in prange(m_rows):
        for n in range(n0, xq.shape[1]):
            acc = F32(0.0)
            accm = F32(0.0)
            for i in range(nb):
                o = offs[m] + i * 144
                dw, dmw = f16_to_f32(buf[o], buf[o + 1]), f16_to_f32(buf[o + 2], buf[o + 3])
                isum = np.int64(0)
                imin = np.int64(0)
                for c in range(4):
                    sc1, m1 = _scale_min_k4(2 * c, buf, o + 4)
                    sc2, m2 = _scale_min_k4(2 * c + 1, buf, o + 4)
                    d1 = np.int64(0)
                    d2 = np.int64(0)
                    qo = o + 16 + 32 * c
                    xo = i * QK_K + 64 * c
                    for l in range(32):
                        q = np.int64(buf[qo + l])
                        d1 += (q & 0xF) * np.int64(xq[xo + l, n])
                        d2 += (q >> 4) * np.int64(xq[xo + 32 + l, n])
                    isum += sc1 * d1 + sc2 * d2
                    imin += (m1 * (np.int64(bsums[i * 16 + 4 * c, n]) + bsums[i * 16 + 4 * c + 1, n])
                             + m2 * (np.int64(bsums[i * 16 + 4 * c + 2, n]) + bsums[i * 16 + 4 * c + 3, n]))
                dx = xd[i, n]
                acc = fma_f32(F32(isum), dw * dx, acc)
                accm = fma_f32(F32(imin), dmw * dx, accm)
            out[n, m] = acc - accm


# ---- Q6_K --------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _q6_k_value(buf, o, e):
    """Integer (-32..31) of element e of the Q6_K super-block at buf[o]."""
    h, rest = e // 128, e % 128
    g, l = rest // 32, rest % 32
    lo = (np.int32(buf[o + 64 * h + 32 * (g % 2) + l]) >> (4 * (g // 2))) & 0xF
    hi = (np.int32(buf[o + 128 + 32 * h + l]) >> (2 * g)) & 3
    return (lo | (hi << 4)) - 32


@njit(parallel=True, cache=True, fastmath={"contract"})
def _mul_mat_q6_k_tiled(buf, offs, xq, xd, out):
    """ggml-cpu/tiled's Q6_K sums: per super-block the integer sum (16-element sub-block sums,
    exact in float32, added in float64), rounded to float32, times d_w, then fma'd with d_x."""
    m_rows = offs.shape[0]
    nb = xq.shape[0] // QK_K
    n_cols = xq.shape[1]
    row_tasks = (m_rows + GEMM_ROWS - 1) // GEMM_ROWS
    col_tasks = (n_cols + GEMM_COLS - 1) // GEMM_COLS
    for task in prange(row_tasks * col_tasks):
        m0 = (task // col_tasks) * GEMM_ROWS
        n0 = (task % col_tasks) * GEMM_COLS
        nn = min(GEMM_COLS, n_cols - n0)
        acc = np.zeros((GEMM_ROWS, nn), dtype=np.float32)
        isum = np.empty((GEMM_ROWS, nn), dtype=np.float64)
        p = np.empty((GEMM_ROWS, nn), dtype=np.float32)
        w = np.empty((GEMM_ROWS, QK_K), dtype=np.float32)
        dw = np.empty(GEMM_ROWS, dtype=np.float32)
        for i in range(nb):
            for r in range(GEMM_ROWS):
                o = offs[min(m0 + r, m_rows - 1)] + i * 210
                dw[r] = f16_to_f32(buf[o + 208], buf[o + 209])
                for e in range(QK_K):
                    w[r, e] = F32(_q6_k_value(buf, o, e) * np.int32(np.int8(buf[o + 192 + e // 16])))
            isum[:] = 0.0
            for sb in range(16):
                p[:] = 0.0
                for k in range(16 * sb, 16 * sb + 16, 4):
                    x0 = xq[i * QK_K + k, n0:n0 + nn]
                    x1 = xq[i * QK_K + k + 1, n0:n0 + nn]
                    x2 = xq[i * QK_K + k + 2, n0:n0 + nn]
                    x3 = xq[i * QK_K + k + 3, n0:n0 + nn]
                    for r in range(GEMM_ROWS):
                        pr = p[r]
                        w0, w1, w2, w3 = w[r, k], w[r, k + 1], w[r, k + 2], w[r, k + 3]
                        for ii in range(nn):
                            pr[ii] += w0 * x0[ii] + w1 * x1[ii] + w2 * x2[ii] + w3 * x3[ii]
                for r in range(GEMM_ROWS):
                    sr, pr = isum[r], p[r]
                    for ii in range(nn):
                        sr[ii] += np.float64(pr[ii])
            xdi = xd[i, n0:n0 + nn]
            for r in range(GEMM_ROWS):
                ar, sr, dr = acc[r], isum[r], dw[r]
                for ii in range(nn):
                    ar[ii] = fma_f32(F32(sr[ii]) * dr, xdi[ii], ar[ii])
        for r in range(min(GEMM_ROWS, m_rows - m0)):
            for ii in range(nn):
                out[n0 + ii, m0 + r] = acc[r, ii]


@njit(parallel=True, cache=True)
def _mul_mat_q6_k_vec_dot(buf, offs, xq, xd, bsums, out):
    """ggml_vec_dot_q6_K_q8_K (AVX2, ggml's choice under 8 columns): per super-block 8 int32
    lanes, lane l = sum over halves h and 32-element groups g of scale[8h + 2g + (l >= 4)]
    times the 4 products (unsigned q6) of elements 128h + 32g + 4l .. + 3, minus
    32 * (bsum[2l] scale[2l] + bsum[2l + 1] scale[2l + 1]); lane = fma(d_x * d_w, lane, lane);
    hsum8."""
    m_rows = offs.shape[0]
    nb = xq.shape[0] // QK_K
    for m in prange(m_rows):
        for n in range(xq.shape[1]):
            acc = np.zeros(8, dtype=np.float32)
            for i in range(nb):
                o = offs[m] + i * 210
                d = xd[i, n] * f16_to_f32(buf[o + 208], buf[o + 209])
                for lane in range(8):
                    tot = np.int64(0)
                    for h in range(2):
                        for g in range(4):
                            sc = np.int64(np.int8(buf[o + 192 + 8 * h + 2 * g + (1 if lane >= 4 else 0)]))
                            part = np.int64(0)
                            for t in range(4):
                                e = 128 * h + 32 * g + 4 * lane + t
                                part += np.int64(_q6_k_value(buf, o, e) + 32) * np.int64(xq[i * QK_K + e, n])
                            tot += sc * part
                    sub = (np.int64(bsums[i * 16 + 2 * lane, n]) * np.int8(buf[o + 192 + 2 * lane])
                           + np.int64(bsums[i * 16 + 2 * lane + 1, n]) * np.int8(buf[o + 192 + 2 * lane + 1]))
                    acc[lane] = fma_f32(d, F32(tot - 32 * sub), acc[lane])
            out[n, m] = hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7])


# ---- dispatch ----------------------------------------------------------------------------
Q0_BLOCK_BYTES = {GGMLType.Q5_0: 22, GGMLType.Q8_0: 34}
Q6_K_TILED_MIN_COLS = 8  # ggml_tiled_min_batch


def supports(type: GGMLType, m_rows: int) -> bool:
    """Whether products with a `type` matrix of m_rows rows follow ggml's order here (Q4_K
    only as ggml repacks it: rows a multiple of 8)."""
    return type in Q0_BLOCK_BYTES or type == GGMLType.Q6_K or (type == GGMLType.Q4_K and m_rows % 8 == 0)


def mul_mat(type: GGMLType, buf: np.ndarray, offs: np.ndarray, x: np.ndarray, out: np.ndarray, scratch) -> None:
    """out (N, M) = x (N, K) times the M quantized rows at buf[offs] (ggml's sums, module doc)."""
    n, k = x.shape
    if n == 0:
        return
    if type in Q0_BLOCK_BYTES:
        nb = k // QK
        xq = scratch.get("q8_lanes", nb * 32 * n).reshape(nb, 4, 8, n)
        xd = scratch.get("q8_scales", nb * n).reshape(nb, n)
        quantize_q8_0_lanes(x, xq, xd)
        _mul_mat_q0(buf, offs, Q0_BLOCK_BYTES[type], type == GGMLType.Q8_0, xq, xd, out)
        return
    nb = k // QK_K
    xq = scratch.get("q8k", k * n).reshape(k, n)
    xd = scratch.get("q8k_scales", nb * n).reshape(nb, n)
    bsums = scratch.get("q8k_bsums", nb * 16 * n).view(np.int32).reshape(nb * 16, n)
    quantize_q8_k_cols(x, xq, xd, bsums)
    if type == GGMLType.Q4_K:
        n_gemm = n - n % 4
        if n_gemm:
            _mul_mat_q4_k_gemm(buf, offs, xq, xd, bsums, out, n_gemm)
        if n_gemm < n:
            _mul_mat_q4_k_gemv(buf, offs, xq, xd, bsums, out, n_gemm)
    elif n >= Q6_K_TILED_MIN_COLS:
        _mul_mat_q6_k_tiled(buf, offs, xq, xd, out)
    else:
        _mul_mat_q6_k_vec_dot(buf, offs, xq, xd, bsums, out)
