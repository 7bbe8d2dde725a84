"""Products of a 32-block quantized matrix with one activation column (a generated token)
straight from the packed blocks, as ggml's vec_dot does them: the
activations quantized to Q8_0 (int8 and an fp16 scale per 32 values, exactly as
qmatmul rounds them), an integer dot product per block, the block sums scaled by
d_w * d_x. Nothing of the matrix is expanded to float32, which for one token is the
whole cost of the tile path (dequantize every weight, then a matrix-vector BLAS call).

Each block term isum * d_w * d_x is exact in float64 (|isum| < 2^19, the scales fp16), and
a row's blocks add up in float64: the result is the float64 product of the weights and the
rounded activations, rounded once to float32, for any thread count (rows are independent).
Types here: Q8_0 (Gemma 3's 262,144-row output head, most of a generated token's work);
tried and measured slower than the tile path: Q5_0 (unpacking its 5-bit weights per block
costs more than dequantizing a tile), int16 products and per-task buffers (bench/RESULTS.md).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...quants.common import F32, f16_to_f32
from ...quants.simple import activation_block_scale
from ...types import GGMLType

QK = 32
MAX_COLUMNS = 1  # measured on the 262,144 x 640 head at -t 2: 38 ms against 70 for one column, even at 2, slower from 4


@njit(parallel=True, cache=True)
def quantize_activations_q8_0(x, qs, d):
    """x (N, K) float32 -> qs (N, K) int8 and d (N, K/32) float32 (fp16 values): the integers
    and scales of the values quants.simple.round_rows_q8_0 rounds x to."""
    nb = x.shape[1] // QK
    for r in prange(x.shape[0]):
        for i in range(nb):
            d[r, i], idd = activation_block_scale(x[r], i * QK)
            for j in range(QK):
                qs[r, i * QK + j] = np.int8(np.rint(F32(x[r, i * QK + j] * idd)))


@njit(cache=True, inline="always")
def _block_dots(wq, dw, qs, d, b, acc):
    """acc[n] += (sum_j wq[j] * qs[n, b*32 + j]) * dw * d[n, b] for every column n."""
    o = b * QK
    for n in range(qs.shape[0]):
        isum = np.int32(0)
        for j in range(QK):
            isum += np.int32(wq[j]) * np.int32(qs[n, o + j])
        acc[n] += np.float64(isum) * (np.float64(dw) * np.float64(d[n, b]))


@njit(parallel=True, cache=True)
def dot_q8_0(buf, offs, qs, d, out):
    """out[n, m] = row m of a Q8_0 matrix (bytes at buf[offs[m]]) . activations n."""
    nb = qs.shape[1] // QK
    sbuf = buf.view(np.int8)
    for m in prange(offs.shape[0]):
        acc = np.zeros(qs.shape[0], dtype=np.float64)
        for b in range(nb):
            o = offs[m] + b * 34
            _block_dots(sbuf[o + 2:o + 34], f16_to_f32(buf[o], buf[o + 1]), qs, d, b, acc)
        for n in range(qs.shape[0]):
            out[n, m] = F32(acc[n])


DOT_KERNELS = {GGMLType.Q8_0: dot_q8_0}


def supports(type: GGMLType, n_columns: int) -> bool:
    """Whether a product with `n_columns` activation columns takes the integer path."""
    return type in DOT_KERNELS and 0 < n_columns <= MAX_COLUMNS


def mul_mat_dot(type: GGMLType, buf: np.ndarray, offs: np.ndarray, x: np.ndarray, out: np.ndarray, scratch) -> None:
    """out (N, M) = x~ (N, K) @ W^T for a few columns N (see the module docstring)."""
    n, k = x.shape
    qs = scratch.get("act_q8", -(-n * k // 4)).view(np.int8)[:n * k].reshape(n, k)
    d = scratch.get("act_d", n * (k // QK)).reshape(n, k // QK)
    quantize_activations_q8_0(np.ascontiguousarray(x), qs, d)
    DOT_KERNELS[type](buf, offs, qs, d, out)
