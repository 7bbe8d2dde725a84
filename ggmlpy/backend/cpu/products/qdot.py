"""Products of a Q5_K matrix with a few activation columns (generated tokens) straight from the
packed blocks. (Q4_0, Q5_0, Q8_0, Q4_K and Q6_K products, whatever their column count, go
through qexact.py, which sums as llama.cpp's x86 kernels do; Q5_K has no kernel in ggml's
order yet, so it keeps this one, and its result is not llama.cpp's bit for bit.) As ggml's
vec_dot does them: the activations quantized to Q8_K (qexact.quantize_q8_k: exactly the
values qmatmul rounds them to), integer dot products per sub-block, the sums scaled by the blocks' scales. Nothing of the matrix is expanded to float32, which for one token is
the whole cost of the tile path (dequantize every weight, then a matrix-vector BLAS call).

The integer sums are computed in float32 lanes: weights and activations are small
integers, every product and every partial sum of a sub-block stays below 2^24, so the
float32 sums are exact in any order. That lets LLVM vectorise them (fastmath reassociation
on those loops only), where int8 products promoted to numba's int64 stay scalar. A row's
sub-block terms are scaled and added in float64 in order: the result is the float64
product of the weights and the rounded activations (to float64 rounding of the
scale-and-min terms), rounded once to float32, for any thread count (rows are independent).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from ....quants.common import F32, QK_K, f16_to_f32
from ....quants.kquants import scale_min_k4
from .qexact import ROWS, quantize_q8_k

QK = 32
INT_LANES = {"reassoc", "contract", "nsz"}  # integer-valued float32 sums: exact in any order
MAX_COLUMNS = 4  # bench/qdot_bench.py (before qexact): 1.1-2.3x the tile path at 4 columns, 3-5.7x at one


# ---- integer sums of one (sub-)block, in float32 lanes -------------------------------------------
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


# ---- one row's dot product -------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _row_q5_k(buf, o, x, xd, xs):
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


# ---- the product: rows in parallel, each column in turn ---------------------------------------------
@njit(parallel=True, cache=True)
def dot_rows(buf, offs, xq, xd, xs, out):
    """out[n, m] = row m of a Q5_K matrix (bytes at buf[offs[m]]) . activation column n."""
    for m in prange(offs.shape[0]):
        for n in range(xq.shape[0]):
            out[n, m] = F32(_row_q5_k(buf, offs[m], xq[n], xd[n], xs[n]))


def plan_q5_k(n: int, m: int, k: int, block_sums: bool = False) -> Callable:
    """out (N, M) = x~ (N, K) @ W^T for a few columns N (see the module docstring), planned:
    the type table (type_table.py) gives it products of up to MAX_COLUMNS columns."""
    def run(buf: np.ndarray, offs: np.ndarray, x: np.ndarray, out: np.ndarray, scratch) -> None:
        xq = scratch.get("act_q", n * k)
        xd = scratch.get("act_d", n * (k // QK_K))
        xs = scratch.get("act_sums", n * (k // QK))
        quantize_q8_k(np.ascontiguousarray(x), ROWS, xq, xd, xs)  # the integers, scales and sums per 32
        dot_rows(buf, offs, xq.reshape(n, k), xd.reshape(n, k // QK_K), xs.reshape(n, k // QK), out)
    return run
