"""MUL_MAT with an F32 or F16 first operand as ggml-cpu computes it (simd.py says why the
order), so that results do not depend on the BLAS library or the CPU it runs on.

For F16, ggml rounds the second operand to F16 first. Then, with at least 2 of its rows, K
a multiple of 16 and the first operand's rows a multiple of 4, it hands the product to
llamafile's tinyBLAS (AVX-512: 16 lanes, lane t summing elements t, t + 16, ... by fma,
the lanes added as _mm512_reduce_add_ps); otherwise each element is ggml_vec_dot_f16 or
ggml_vec_dot_f32. Without flash attention an F16 cache's attention products (K x Q,
V x softmax) come here; F32 weights (small models) do too.

Arrays: a [a3, a2, M, K] and b [b3, b2, N, K] float32 (values of halves for F16; b2 a
multiple of a2, b3 of a3, as ggml broadcasts), out [b3, b2, N, M].
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .simd import fma_f32, reduce16, vec_dot_f16, vec_dot_f32
from .vecir import f16_tile_4x4

LANES = 16


def uses_tinyblas(m: int, n: int, k: int) -> bool:
    """llamafile_sgemm's conditions for an F32 or F16 product (AVX-512 build)."""
    return n >= 2 and k % LANES == 0 and m % 4 == 0


@njit(parallel=True, cache=True)
def _tinyblas_blocks(a, b, out, m4, n4):
    """The 4 x 4 blocks of each matrix pair: vecir.f16_tile_4x4."""
    a3, a2 = a.shape[0], a.shape[1]
    b3, b2 = b.shape[0], b.shape[1]
    r3, r2 = b3 // a3, b2 // a2
    mb, nbk = m4 // 4, n4 // 4
    for task in prange(b3 * b2 * mb):
        i3 = task // (b2 * mb)
        i2 = (task // mb) % b2
        m0 = (task % mb) * 4
        for n0 in range(0, n4, 4):
            f16_tile_4x4(a[i3 // r3, i2 // r2], b[i3, i2], out[i3, i2], m0, n0)


def mul_mat(a: np.ndarray, b: np.ndarray, out: np.ndarray, tinyblas: bool, halves: bool) -> None:
    """out = the products (module doc); a, b C-contiguous float32, out C-contiguous; halves:
    an F16 product (ggml_vec_dot_f16's sums where tinyBLAS does not take it)."""
    if tinyblas:
        m4, n4 = a.shape[2] - a.shape[2] % 4, b.shape[2] - b.shape[2] % 4
        _tinyblas_blocks(a, b, out, m4, n4)
        _mul_mat_rest(a, b, out, True, halves, m4, n4)
    else:
        _mul_mat_rest(a, b, out, False, halves, 0, 0)


@njit(parallel=True, cache=True)
def _mul_mat_rest(a, b, out, tinyblas, halves, m_done, n_done):
    """Each element not in the first m_done x n_done block, one at a time."""
    a3, a2, m_rows, k = a.shape
    b3, b2, n_cols = b.shape[0], b.shape[1], b.shape[2]
    r3, r2 = b3 // a3, b2 // a2
    for task in prange(b3 * b2 * m_rows):
        i3 = task // (b2 * m_rows)
        i2 = (task // m_rows) % b2
        m = task % m_rows
        ar = a[i3 // r3, i2 // r2, m]
        acc = np.empty(64, dtype=np.float32)
        for n in range(n_cols):
            if m < m_done and n < n_done:
                continue
            br = b[i3, i2, n]
            if tinyblas:
                acc[:LANES] = 0.0
                for l in range(0, k, LANES):
                    for t in range(LANES):
                        acc[t] = fma_f32(ar[l + t], br[l + t], acc[t])
                out[i3, i2, n, m] = reduce16(acc, 0)
            elif halves:
                out[i3, i2, n, m] = vec_dot_f16(ar, br, k, acc)
            else:
                out[i3, i2, n, m] = vec_dot_f32(ar, br, k, acc)
