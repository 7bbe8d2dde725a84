"""Products of a Q4_0 or Q5_K matrix with a few activation columns (generated tokens) straight
from the packed blocks. (Q5_0, Q8_0, Q4_K and Q6_K products, whatever their column count, go
through qexact.py, which sums as llama.cpp's x86 kernels do; the two types here have no
kernel in ggml's order yet, so they keep this one, and its result is not llama.cpp's bit for
bit.) As ggml's vec_dot does them: the activations quantized to the
weight type's vec_dot type (Q8_0 for the 32-blocks, Q8_K for the K-quants; exactly the
values qmatmul rounds them to), integer dot products per (sub-)block, the sums scaled by
the blocks' scales. Nothing of the matrix is expanded to float32, which for one token is
the whole cost of the tile path (dequantize every weight, then a matrix-vector BLAS call).

The integer sums are computed in float32 lanes: weights and activations are small
integers, every product and every partial sum of a (sub-)block stays below 2^24, so the
float32 sums are exact in any order. That lets LLVM vectorise them (fastmath reassociation
on those loops only), where int8 products promoted to numba's int64 stay scalar. A row's
(sub-)block terms are scaled and added in float64 in order: the result is the float64
product of the weights and the rounded activations (exactly so for Q4_0, whose block terms are
exact in float64; to float64 rounding for Q5_K's scale-and-min terms), rounded once to float32, for any thread count (rows are independent).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...quants import VEC_DOT_TYPE
from ...quants.common import F32, QK_K, f16_to_f32, nearest_int
from ...quants.kquants import activation_superblock_scale, scale_min_k4
from ...quants.simple import activation_block_scale
from ...types import GGMLType

QK = 32
INT_LANES = {"reassoc", "contract", "nsz"}  # integer-valued float32 sums: exact in any order
MAX_COLUMNS = 4  # bench/qdot_bench.py (before qexact): 1.1-2.3x the tile path at 4 columns, 3-5.7x at one


# ---- the activations: integers (as float32), scales, and sums per 32 ---------------------------
@njit(parallel=True, cache=True)
def quantize_activations_q8_0(x, xq, xd, xs):
    """x (N, K) float32 -> the integers xq (N, K), scales xd (N, K/32) and integer sums
    xs (N, K/32) of the Q8_0 blocks quants.simple.round_rows_q8_0 rounds x to."""
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        for i in range(nb):
            d, idd = activation_block_scale(x[r], i * QK)
            s = F32(0.0)
            for j in range(QK):
                q = F32(np.rint(F32(x[r, i * QK + j] * idd)))
                xq[r, i * QK + j] = q
                s += q
            xd[r, i], xs[r, i] = d, s


@njit(parallel=True, cache=True)
def quantize_activations_q8_k(x, xq, xd, xs):
    """The same for the Q8_K super-blocks quants.kquants.round_rows_q8_k rounds x to:
    xd (N, K/256) holds the super-blocks' float32 scales, xs the integer sums per 32."""
    nb = x.shape[1] // QK_K
    for r in prange(x.shape[0]):
        for i in range(nb):
            d, iscale = activation_superblock_scale(x[r], i * QK_K)
            xd[r, i] = d
            for g in range(QK_K // QK):
                s = F32(0.0)
                for j in range(QK):
                    e = i * QK_K + g * QK + j
                    q = F32(min(127, nearest_int(iscale * x[r, e]))) if d != 0 else F32(0.0)
                    xq[r, e] = q
                    s += q
                xs[r, i * (QK_K // QK) + g] = s


# ---- integer sums of one (sub-)block, in float32 lanes -------------------------------------------
@njit(cache=True, fastmath=INT_LANES)
def _isum_q4_0(w, x):
    s = F32(0.0)
    for j in range(w.shape[0]):
        q = np.int32(w[j])
        s += F32((q & 0xF) - 8) * x[j] + F32((q >> 4) - 8) * x[16 + j]
    return s


@njit(cache=True, fastmath=INT_LANES)
def _isums_nibbles_q5(w, wh, c, x):
    """(low nibbles of the 32 bytes w . x[:32], high nibbles . x[32:64]) with the fifth bits
    2c and 2c+1 of the 32 bytes wh: a 64-element group of Q5_K."""
    s_lo = F32(0.0)
    s_hi = F32(0.0)
    for l in range(QK):
        q = np.int32(w[l])
        h = np.int32(wh[l])
        s_lo += F32((q & 0xF) | (((h >> (2 * c)) & 1) << 4)) * x[l]
        s_hi += F32((q >> 4) | (((h >> (2 * c + 1)) & 1) << 4)) * x[QK + l]
    return s_lo, s_hi


# ---- one row's dot product per type ----------------------------------------------------------------
@njit(cache=True, inline="always")
def _row_q4_0(buf, sbuf, o, x, xd, xs):
    acc = 0.0
    for b in range(xd.shape[0]):
        ob = o + b * 18
        acc += np.float64(_isum_q4_0(buf[ob + 2:ob + 18], x[b * QK:(b + 1) * QK])) * (
            np.float64(f16_to_f32(buf[ob], buf[ob + 1])) * np.float64(xd[b]))
    return acc


@njit(cache=True, inline="always")
def _row_q5_k(buf, sbuf, o, x, xd, xs):
    acc = 0.0
    for i in range(xd.shape[0]):
        ob = o + i * 176
        s1 = np.int64(0)
        s2 = np.int64(0)
        for c in range(4):
            sc1, m1 = scale_min_k4(2 * c, buf, ob + 4)
            sc2, m2 = scale_min_k4(2 * c + 1, buf, ob + 4)
            xo = i * QK_K + 64 * c
            s_lo, s_hi = _isums_nibbles_q5(buf[ob + 48 + 32 * c:ob + 80 + 32 * c], buf[ob + 16:ob + 48], c,
                                           x[xo:xo + 64])
            s1 += sc1 * np.int64(s_lo) + sc2 * np.int64(s_hi)
            g = i * 8 + 2 * c
            s2 += m1 * np.int64(xs[g]) + m2 * np.int64(xs[g + 1])
        d = np.float64(f16_to_f32(buf[ob], buf[ob + 1]))
        dmin = np.float64(f16_to_f32(buf[ob + 2], buf[ob + 3]))
        acc += (d * np.float64(s1) - dmin * np.float64(s2)) * np.float64(xd[i])
    return acc


# ---- the products: rows in parallel, each column in turn ---------------------------------------------
TYPES = (GGMLType.Q4_0, GGMLType.Q5_K)
_Q4_0 = int(GGMLType.Q4_0)


@njit(cache=True, inline="always")
def _row(type, buf, sbuf, o, x, xd, xs):
    """Row at buf[o] of a `type` matrix . one column, in float64."""
    if type == _Q4_0:
        return _row_q4_0(buf, sbuf, o, x, xd, xs)
    return _row_q5_k(buf, sbuf, o, x, xd, xs)


@njit(parallel=True, cache=True)
def dot_rows(type, buf, offs, xq, xd, xs, out):
    """out[n, m] = row m of a `type` matrix (bytes at buf[offs[m]]) . activation column n.
    One kernel for both types: one compilation, one cache entry (the branch is per row)."""
    sbuf = buf.view(np.int8)
    for m in prange(offs.shape[0]):
        for n in range(xq.shape[0]):
            out[n, m] = F32(_row(type, buf, sbuf, offs[m], xq[n], xd[n], xs[n]))


_ACTIVATIONS = {GGMLType.Q8_0: (quantize_activations_q8_0, QK), GGMLType.Q8_K: (quantize_activations_q8_k, QK_K)}


def supports(type: GGMLType, n_columns: int) -> bool:
    """Whether a product with `n_columns` activation columns takes the integer path."""
    return type in TYPES and 0 < n_columns <= MAX_COLUMNS


def mul_mat_dot(type: GGMLType, buf: np.ndarray, offs: np.ndarray, x: np.ndarray, out: np.ndarray, scratch) -> None:
    """out (N, M) = x~ (N, K) @ W^T for a few columns N (see the module docstring)."""
    n, k = x.shape
    quantize, block = _ACTIVATIONS[VEC_DOT_TYPE[type]]
    xq = scratch.get("act_q", n * k).reshape(n, k)
    xd = scratch.get("act_d", n * (k // block)).reshape(n, k // block)
    xs = scratch.get("act_sums", n * (k // QK)).reshape(n, k // QK)
    quantize(np.ascontiguousarray(x), xq, xd, xs)
    dot_rows(int(type), buf, offs, xq, xd, xs, out)
